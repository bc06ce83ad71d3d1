"""Mamba-2 SSD ops: every bad input raises a clear error naming the argument before any launch (meta tensors,
no GPU needed), and the decode reference's cache-slot indirection."""
from __future__ import annotations

import math

import pytest
import torch

from tk_backend import mamba, reference
from tests.accuracy import assert_close

META = torch.device("meta")


def scan_inputs(b=2, l=100, h=4, p=64, g=2, n=64, dtype=torch.bfloat16, device=META):
    return dict(
        x=torch.empty(b, l, h, p, dtype=dtype, device=device), dt=torch.empty(b, l, h, device=device),
        A=torch.empty(h, device=device), B=torch.empty(b, l, g, n, dtype=dtype, device=device),
        C=torch.empty(b, l, g, n, dtype=dtype, device=device), chunk_size=64,
    )


def test_valid_input_gets_past_validation():
    # meta tensors pass every check; the launch itself then needs the extension and a GPU
    with pytest.raises(RuntimeError):
        mamba.mamba_chunk_scan_combined(**scan_inputs())


@pytest.mark.parametrize("change,error,message", [
    (dict(x=torch.empty(2, 100, 4, 64, device=META)), TypeError, "x must be bfloat16 or float16"),
    (dict(x=torch.empty(2, 100, 4, 64, 1, dtype=torch.bfloat16, device=META)), ValueError, "x must have 4 dimensions"),
    (dict(x=torch.empty(2, 100, 4, 96, dtype=torch.bfloat16, device=META)), ValueError, "headdim"),
    (dict(x=torch.empty(2, 100, 4, 64, dtype=torch.bfloat16)), ValueError, "x must be a CUDA tensor"),
    (dict(dt=torch.empty(2, 100, 3, device=META)), ValueError, "dt must have shape"),
    (dict(dt=torch.empty(2, 100, 4, dtype=torch.int32, device=META)), TypeError, "dt must be a floating-point"),
    (dict(A=torch.empty(3, device=META)), ValueError, "A must have shape"),
    (dict(B=torch.empty(2, 100, 2, 64, device=META)), TypeError, "B must have x's dtype"),
    (dict(B=torch.empty(2, 100, 2, 32, dtype=torch.bfloat16, device=META),
          C=torch.empty(2, 100, 2, 32, dtype=torch.bfloat16, device=META)), ValueError, "dstate"),
    (dict(B=torch.empty(2, 100, 3, 64, dtype=torch.bfloat16, device=META),
          C=torch.empty(2, 100, 3, 64, dtype=torch.bfloat16, device=META)), ValueError, "multiple of ngroups"),
    (dict(C=torch.empty(2, 99, 2, 64, dtype=torch.bfloat16, device=META)), ValueError, "C must have shape"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(D=torch.empty(5, device=META)), ValueError, "D must have shape"),
    (dict(z=torch.empty(2, 100, 4, 32, dtype=torch.bfloat16, device=META)), ValueError, "z must have shape"),
    (dict(dt_bias=torch.empty(4, 64, device=META)), ValueError, "dt_bias must be per head"),
    (dict(initial_states=torch.empty(2, 4, 64, 32, device=META)), ValueError, "initial_states must have shape"),
    (dict(seq_idx=torch.zeros(2, 100, dtype=torch.int32, device=META)), ValueError, "seq_idx without cu_seqlens"),
    (dict(cu_seqlens=torch.zeros(3, dtype=torch.int32, device=META)), ValueError, "batch 1"),
    (dict(return_varlen_states=True), ValueError, "return_varlen_states needs cu_seqlens"),
    (dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit"),
    (dict(dt_limit=0.5), TypeError, "dt_limit"),
])
def test_scan_rejects(change, error, message):
    kw = scan_inputs()
    kw.update(change)
    with pytest.raises(error, match=message):
        mamba.mamba_chunk_scan_combined(**kw)


def test_scan_rejects_unaddressable_x():
    kw = scan_inputs()
    kw["x"] = torch.empty(2, 100, 4, 65, dtype=torch.bfloat16, device=META)[..., :64]
    with pytest.raises(ValueError, match="x must have a contiguous last dimension and 16-byte aligned"):
        mamba.mamba_chunk_scan_combined(**kw)


def test_varlen_rejects_initial_states_per_batch():
    kw = scan_inputs(b=1, l=300)
    kw["cu_seqlens"] = torch.zeros(4, dtype=torch.int32, device=META)
    kw["initial_states"] = torch.empty(1, 4, 64, 64, device=META)
    with pytest.raises(ValueError, match=r"initial_states must have shape \(3, 4, 64, 64\)"):
        mamba.mamba_chunk_scan_combined(**kw)


def test_varlen_form_checks_rank():
    kw = scan_inputs(b=1, l=300)
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        mamba.mamba_chunk_scan_varlen(kw["x"], kw["dt"][0], kw["A"], kw["B"][0], kw["C"][0],
                                      torch.zeros(2, dtype=torch.int32, device=META))


def update_inputs(b=3, h=4, p=64, g=2, n=64, slots=5):
    return dict(
        state=torch.empty(slots, h, p, n, device=META), x=torch.empty(b, h, p, dtype=torch.bfloat16, device=META),
        dt=torch.empty(b, h, p, device=META), A=torch.empty(h, p, n, device=META),
        B=torch.empty(b, g, n, dtype=torch.bfloat16, device=META), C=torch.empty(b, g, n, dtype=torch.bfloat16, device=META),
        state_batch_indices=torch.zeros(b, dtype=torch.int32, device=META),
    )


def test_update_valid_input_gets_past_validation():
    with pytest.raises(RuntimeError):
        mamba.selective_state_update(**update_inputs())


@pytest.mark.parametrize("change,error,message", [
    (dict(x=torch.empty(3, 4, 64, device=META)), TypeError, "x must be bfloat16 or float16"),
    (dict(state=torch.empty(5, 4, 64, 32, device=META)), ValueError, "state must be"),
    (dict(state=torch.empty(5, 4, 64, 64, dtype=torch.float16, device=META)), TypeError, "state must be float32"),
    (dict(dt=torch.empty(3, 5, device=META)), ValueError, "dt must have shape"),
    (dict(A=torch.empty(4, 64, device=META)), ValueError, "A must have shape"),
    (dict(B=torch.empty(3, 3, 64, dtype=torch.bfloat16, device=META),
          C=torch.empty(3, 3, 64, dtype=torch.bfloat16, device=META)), ValueError, "multiple of ngroups"),
    (dict(C=torch.empty(3, 2, 64, device=META)), TypeError, "C must have x's dtype"),
    (dict(D=torch.empty(7, device=META)), ValueError, "D must have shape"),
    (dict(state_batch_indices=torch.zeros(2, dtype=torch.int32, device=META)), ValueError, "state_batch_indices"),
    (dict(state_batch_indices=None), ValueError, "without state_batch_indices"),
])
def test_update_rejects(change, error, message):
    kw = update_inputs()
    kw.update(change)
    with pytest.raises(error, match=message):
        mamba.selective_state_update(**kw)


def test_reference_update_with_cache_slots(seed):
    b, h, p, g, n, slots = 4, 4, 3, 2, 5, 7
    state = torch.randn(slots, h, p, n)
    x, dt, A = torch.randn(b, h, p), torch.randn(b, h), -torch.rand(h)
    B, C, D = torch.randn(b, g, n), torch.randn(b, g, n), torch.randn(h)
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    expected_state = state.clone()
    rows = state[[5, 0, 2]].clone()
    y_rows = reference.selective_state_update(rows, x[[0, 2, 3]], dt[[0, 2, 3]], A, B[[0, 2, 3]], C[[0, 2, 3]], D,
                                              dt_softplus=True)
    expected_state[[5, 0, 2]] = rows
    y = reference.selective_state_update(state, x, dt, A, B, C, D, dt_softplus=True, state_batch_indices=idx)
    assert_close(state, expected_state, rel=1e-6, atol=1e-6, what="slots")
    assert_close(y[[0, 2, 3]], y_rows, rel=1e-6, atol=1e-6, what="y")
    assert torch.equal(y[1], torch.zeros_like(y[1]))


def test_float32_conversion_keeps_broadcast_dims():
    """vLLM's mixer passes dt as a bf16 [batch, nheads] view expanded over headdim: converted, it stays a view with
    a zero stride (the update kernel's per-head form reads the strides), and its values are dt's."""
    dt = torch.randn(4, 3, dtype=torch.bfloat16)[:, :, None].expand(-1, -1, 5)
    f = mamba._f32(dt)
    assert f.dtype == torch.float32 and f.stride() == (3, 1, 0) and torch.equal(f, dt.float())
    per_head = torch.randn(3, dtype=torch.float16)[:, None, None].expand(-1, 5, 7)
    assert mamba._f32(per_head).stride() == (1, 0, 0)
    dense = torch.randn(2, 3, dtype=torch.float16)
    assert mamba._f32(dense).stride() == (3, 1) and torch.equal(mamba._f32(dense), dense.float())
