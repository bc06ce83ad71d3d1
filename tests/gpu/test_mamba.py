"""Mamba-2 SSD kernels against the float32 sequential recurrence: dense and varlen scans (initial / final
states, ragged lengths, D, z, groups, both head and state dims), decode updates, prefill-then-decode."""
from __future__ import annotations

import random

import pytest
import torch

import tk_backend
from tk_backend import reference
from tests.accuracy import assert_close

pytestmark = pytest.mark.gpu


def _inputs(b, l, h, p, g, n, dtype=torch.bfloat16):
    dev = "cuda"
    return dict(
        x=torch.randn(b, l, h, p, device=dev, dtype=dtype), dt=torch.randn(b, l, h, device=dev) * 0.5 - 1.0,
        A=-torch.rand(h, device=dev) * 2 - 0.1, B=torch.randn(b, l, g, n, device=dev, dtype=dtype) * 0.3,
        C=torch.randn(b, l, g, n, device=dev, dtype=dtype) * 0.3,
    )


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("p", [64, 128])
@pytest.mark.parametrize("n", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("chunk", [64, 256])
def test_dense(p, n, g, chunk, seed):
    rng = random.Random(seed)
    b, h, l = 2, 4 if g < 4 else 8, rng.choice([1, 63, 64, 65, 200, 333])
    inp = _inputs(b, l, h, p, g, n)
    D, dt_bias = torch.randn(h, device="cuda"), torch.randn(h, device="cuda") * 0.3
    z = torch.randn_like(inp["x"]) if rng.random() < 0.5 else None
    state0 = torch.randn(b, h, p, n, device="cuda") * 0.5 if rng.random() < 0.5 else None
    out = torch.full_like(inp["x"], float("nan"))
    _, final = tk_backend.mamba_chunk_scan_combined(**inp, chunk_size=chunk, D=D, z=z, dt_bias=dt_bias,
                                                    initial_states=state0, dt_softplus=True,
                                                    return_final_states=True, out=out)
    torch.cuda.synchronize()
    ref_y, ref_final = reference.mamba_chunk_scan(**inp, D=D, z=z, dt_bias=dt_bias, initial_states=state0,
                                                  dt_softplus=True)
    what = f"dense p={p} n={n} g={g} l={l} z={z is not None} init={state0 is not None} seed={seed}"
    assert_close(out, ref_y, rel=2e-2, atol=5e-2, what=f"{what} y")
    assert_close(final, ref_final, rel=1e-2, atol=5e-2, what=f"{what} final")


@pytest.mark.parametrize("n", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 8])
def test_varlen_initial_and_final_states(n, g, seed):
    rng = random.Random(seed)
    h, p = 16, 64
    lengths = [rng.choice([0, 1, 17, 64, 100, 129, 300]) for _ in range(6)]
    total = sum(lengths)
    inp = _inputs(1, total, h, p, g, n)
    cu = _cu(lengths)
    state0 = torch.randn(len(lengths), h, p, n, device="cuda") * 0.5
    D = torch.randn(h, p, device="cuda")
    out = torch.full_like(inp["x"], float("nan"))
    _, finals = tk_backend.mamba_chunk_scan_combined(**inp, chunk_size=256, D=D, initial_states=state0,
                                                     cu_seqlens=cu, dt_softplus=True, dt_limit=(0.0, 0.8),
                                                     return_varlen_states=True, out=out)
    torch.cuda.synchronize()
    ref_y, ref_finals = reference.mamba_chunk_scan(**inp, D=D, initial_states=state0, dt_softplus=True,
                                                   dt_limit=(0.0, 0.8), cu_seqlens=cu)
    what = f"varlen n={n} g={g} lengths={lengths} seed={seed}"
    assert_close(out, ref_y, rel=2e-2, atol=5e-2, what=f"{what} y")
    assert_close(finals, ref_finals, rel=1e-2, atol=5e-2, what=f"{what} finals")


# the scan orders up to 2048 sequences longest first; n = 256: the split kernel, many tasks a CTA (its exchange
# barriers across task boundaries)
@pytest.mark.parametrize("num_seqs, n", [(300, 64), (2100, 64), (300, 256)])
def test_varlen_many_skewed_sequences(num_seqs, n, seed):
    """One long sequence among many short ones, in the middle of the batch: the dynamically claimed tasks
    (longest first when the batch is sortable, as given past 2048 sequences) must each still see their own
    sequence, initial state and final state."""
    rng = random.Random(seed)
    h, p, g = 8, 64, 1
    lengths = [rng.choice([0, 1, 2, 3, 65]) for _ in range(num_seqs)]
    lengths[num_seqs // 2] = 640
    inp = _inputs(1, sum(lengths), h, p, g, n)
    cu = _cu(lengths)
    state0 = torch.randn(num_seqs, h, p, n, device="cuda") * 0.5
    out = torch.full_like(inp["x"], float("nan"))
    _, finals = tk_backend.mamba_chunk_scan_combined(**inp, chunk_size=256, initial_states=state0, cu_seqlens=cu,
                                                     dt_softplus=True, return_varlen_states=True, out=out)
    torch.cuda.synchronize()
    ref_y, ref_finals = reference.mamba_chunk_scan(**inp, initial_states=state0, dt_softplus=True, cu_seqlens=cu)
    what = f"varlen num_seqs={num_seqs} n={n} seed={seed}"
    assert_close(out, ref_y, rel=2e-2, atol=5e-2, what=f"{what} y")
    assert_close(finals, ref_finals, rel=1e-2, atol=5e-2, what=f"{what} finals")


def test_varlen_packed_form_matches_batched_form(seed):
    lengths = [70, 5, 260]
    h, p, g, n = 8, 128, 2, 64
    inp = _inputs(1, sum(lengths), h, p, g, n)
    cu = _cu(lengths)
    y1, s1 = tk_backend.mamba_chunk_scan_varlen(inp["x"][0], inp["dt"][0], inp["A"], inp["B"][0], inp["C"][0], cu,
                                                dt_softplus=True)
    y2, s2 = tk_backend.mamba_chunk_scan_combined(**inp, chunk_size=256, cu_seqlens=cu, dt_softplus=True,
                                                  return_final_states=True)
    torch.cuda.synchronize()
    assert torch.equal(y1, y2[0]) and torch.equal(s1, s2)


def test_fp16(seed):
    inp = _inputs(2, 150, 4, 64, 1, 128, dtype=torch.float16)
    out = tk_backend.mamba_chunk_scan_combined(**inp, chunk_size=128)
    ref_y, _ = reference.mamba_chunk_scan(**inp)
    assert_close(out, ref_y, rel=2e-2, atol=5e-2, what=f"fp16 seed={seed}")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_update_with_slots(state_dtype, seed):
    b, h, p, g, n, slots = 5, 8, 64, 2, 128, 9
    state = torch.randn(slots, h, p, n, device="cuda").to(state_dtype)
    x = torch.randn(b, h, p, device="cuda", dtype=torch.bfloat16)
    dt = torch.randn(b, h, device="cuda")[:, :, None].expand(b, h, p)
    A = (-torch.rand(h, device="cuda"))[:, None, None].expand(h, p, n)
    B = torch.randn(b, g, n, device="cuda", dtype=torch.bfloat16)
    C = torch.randn(b, g, n, device="cuda", dtype=torch.bfloat16)
    D, dt_bias = torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
    z = torch.randn_like(x)
    idx = torch.tensor([3, -1, 0, 8, 5], dtype=torch.int32, device="cuda")
    ref_state = state.float().clone()
    ref_y = reference.selective_state_update(ref_state, x, dt, A, B, C, D, z, dt_bias, True, idx)
    out = torch.full_like(x, float("nan"))
    tk_backend.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True, idx, out=out)
    torch.cuda.synchronize()
    keep = idx != -1
    tol = 1e-2 if state_dtype == torch.float32 else 3e-2
    assert_close(out[keep], ref_y[keep], rel=tol, atol=3e-2, what=f"decode y seed={seed}")
    assert_close(state.float(), ref_state, rel=tol, atol=3e-2, what=f"decode state seed={seed}")
    assert torch.isnan(out[1]).all(), "a padded row was written"


@pytest.mark.parametrize("n", [64, 128, 256, 48])  # 48: the generic kernel (no 16-byte vector rows)
@pytest.mark.parametrize("p", [64, 80, 128])      # 80: a CTA's last block of rows is partly past headdim
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("form", ["vllm", "general"])
def test_decode_update_shapes(n, p, state_dtype, misaligned, form, seed):
    """Every update kernel (the vector one at dstate 64/128/256, the generic one otherwise or when a state view's
    rows are not 16-byte aligned) against the reference, in vLLM's form (dt, A, D, dt_bias per head as expanded
    views, no z) and the general one (A per element, z); garbage slot ids (past num_states, negative) skipped like
    padding."""
    dtype = torch.float16 if state_dtype == torch.float16 else torch.bfloat16
    b, h, g, slots = 7, 4, 2, 12
    pool = torch.randn(slots, h, p, n + (1 if misaligned else 0), device="cuda").to(state_dtype)
    state = pool[..., 1:] if misaligned else pool  # rows start 2 or 4 bytes past 16: the generic kernel
    x = torch.randn(b, h, p, device="cuda", dtype=dtype)
    dt = torch.randn(b, h, device="cuda")[:, :, None].expand(b, h, p)
    if form == "vllm":
        A = (-torch.rand(h, device="cuda"))[:, None, None].expand(h, p, n)
    else:
        A = -torch.rand(h, p, n, device="cuda")
    B = torch.randn(b, g, n, device="cuda", dtype=dtype) * 0.5
    C = torch.randn(b, g, n, device="cuda", dtype=dtype) * 0.5
    D, dt_bias = torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
    z = torch.randn_like(x) if form == "general" else None
    idx = torch.tensor([3, -1, 0, slots + 5, 11, -7, 6], dtype=torch.int32, device="cuda")
    keep = (idx >= 0) & (idx < slots)
    ref_state = state.float().clone()
    ref_y = reference.selective_state_update(ref_state, x[keep], dt[keep], A, B[keep], C[keep], D,
                                             None if z is None else z[keep], dt_bias, True, idx[keep])
    untouched, pad_column = state.clone(), pool[..., 0].clone()
    out = torch.full_like(x, float("nan"))
    tk_backend.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True, idx, out=out)
    torch.cuda.synchronize()
    what = f"n={n} p={p} state={state_dtype} misaligned={misaligned} form={form} seed={seed}"
    tol = 1e-2 if state_dtype == torch.float32 else 3e-2
    assert_close(out[keep], ref_y, rel=tol, atol=3e-2, what=f"decode y {what}")
    assert_close(state.float(), ref_state, rel=tol, atol=3e-2, what=f"decode state {what}")
    assert torch.isnan(out[~keep]).all(), f"a padded or garbage-slot row was written ({what})"
    used = idx[keep].long()
    others = torch.ones(slots, dtype=torch.bool, device="cuda")
    others[used] = False
    assert torch.equal(state[others], untouched[others]), f"a state row no batch row names changed ({what})"
    if misaligned:
        assert torch.equal(pool[..., 0], pad_column), f"a write outside the state view ({what})"


def test_prefill_then_decode_equals_longer_prefill(seed):
    b, l, steps, h, p, g, n = 2, 130, 3, 8, 64, 1, 64
    inp = _inputs(b, l + steps, h, p, g, n)
    D, dt_bias = torch.randn(h, device="cuda"), torch.randn(h, device="cuda") * 0.3
    full = tk_backend.mamba_chunk_scan_combined(**inp, chunk_size=64, D=D, dt_bias=dt_bias, dt_softplus=True)
    part = {k: (v[:, :l] if k != "A" else v) for k, v in inp.items()}
    y, state = tk_backend.mamba_chunk_scan_combined(**part, chunk_size=64, D=D, dt_bias=dt_bias, dt_softplus=True,
                                                    return_final_states=True)
    assert_close(y, full[:, :l], rel=1e-3, atol=1e-2, what="prefill part")
    for t in range(l, l + steps):
        y_t = tk_backend.selective_state_update(state, inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t],
                                                inp["C"][:, t], D=D, dt_bias=dt_bias, dt_softplus=True)
        assert_close(y_t, full[:, t], rel=2e-2, atol=3e-2, what=f"decode step {t}")
