"""Based linear attention against the float32 reference: prefill (ragged lengths), state hand-off, decode steps."""
from __future__ import annotations

import random

import pytest
import torch

from tk_backend import based, reference
from tests.accuracy import assert_close

pytestmark = pytest.mark.gpu


def _inputs(b, n, h, dv, dtype, gen_scale=1.0):
    q = (torch.randn(b, n, h, 16, device="cuda") * gen_scale).to(dtype)
    k = (torch.randn(b, n, h, 16, device="cuda") * gen_scale).to(dtype)
    v = torch.randn(b, n, h, dv, device="cuda").to(dtype)
    return q, k, v


def _poison(shape, dtype):
    """Leave a NaN-filled block of this size in the caching allocator, so an unwritten output shows as NaN."""
    t = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    del t


def _check_out(out, ref, use_norm, what):
    # Unnormalised outputs grow with the prefix length: bound elements against the largest.
    atol = 3e-2 if use_norm else 3e-2 * ref.abs().max().item()
    assert_close(out, ref, rel=2e-2, atol=atol, what=what)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_norm", [True, False])
@pytest.mark.parametrize("dv", [64, 128])
def test_prefill_matches_reference(dtype, use_norm, dv, seed):
    rng = random.Random(seed)
    for n in [1, 64, rng.randint(2, 63), rng.randint(65, 700)]:
        q, k, v = _inputs(2, n, 3, dv, dtype)
        _poison((2, n, 3, dv), dtype)
        out = based.parallel_based(q, k, v, use_norm=use_norm)
        torch.cuda.synchronize()
        assert out.dtype == dtype and out.shape == v.shape
        ref = reference.based(q, k, v, use_norm=use_norm)
        _check_out(out, ref, use_norm, f"prefill n={n} dv={dv} {dtype} norm={use_norm} seed={seed}")


def test_fused_chunk_alias_and_scale(seed):
    q, k, v = _inputs(1, 333, 2, 64, torch.bfloat16)
    out = based.fused_chunk_based(q, k, v, scale=0.3)
    ref = reference.based(q, k, v, scale=0.3)
    _check_out(out, ref, True, f"fused_chunk scale=0.3 seed={seed}")


def test_strided_inputs(seed):
    # [B, H, N, D] storage seen as [B, N, H, D]: the layout FLA users often pass
    b, h, n = 2, 4, 300
    q = torch.randn(b, h, n, 16, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, h, n, 16, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    out = based.parallel_based(q, k, v)
    _check_out(out, reference.based(q, k, v), True, f"strided seed={seed}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv", [64, 128])
def test_final_state_and_continuation(dtype, dv, seed):
    rng = random.Random(seed)
    n1, n2 = rng.randint(1, 300), rng.randint(1, 300)
    q, k, v = _inputs(2, n1 + n2, 3, dv, dtype)
    full, full_state = based.parallel_based(q, k, v, output_final_state=True)
    ref_state = reference.based_prefill_state(k, v)
    for field, got, want in zip(ref_state._fields, full_state, ref_state):
        assert_close(got, want, rel=1e-2, atol=1e-2 * want.abs().max().item(), what=f"state.{field} seed={seed}")
    first, state = based.parallel_based(q[:, :n1], k[:, :n1], v[:, :n1], output_final_state=True)
    second, state2 = based.parallel_based(q[:, n1:], k[:, n1:], v[:, n1:], initial_state=state, output_final_state=True)
    _check_out(torch.cat([first, second], 1), reference.based(q, k, v), True, f"continued prefill seed={seed}")
    for field, got, want in zip(ref_state._fields, state2, ref_state):
        assert_close(got, want, rel=1e-2, atol=1e-2 * want.abs().max().item(), what=f"continued {field} seed={seed}")


@pytest.mark.parametrize("use_norm", [True, False])
@pytest.mark.parametrize("inplace", [True, False])
def test_step_matches_reference(use_norm, inplace, seed):
    b, h, dv = 3, 5, 64
    _, k0, v0 = _inputs(b, 40, h, dv, torch.bfloat16)
    state = reference.based_prefill_state(k0, v0)
    q, k, v = (t[:, 0] for t in _inputs(b, 1, h, dv, torch.bfloat16))
    ref_o, ref_state = reference.based_step(q, k, v, state, use_norm=use_norm)
    before = [t.clone() for t in state]
    o, new_state = based.based_step(q, k, v, state, use_norm=use_norm, inplace=inplace)
    torch.cuda.synchronize()
    _check_out(o, ref_o, use_norm, f"step norm={use_norm} seed={seed}")
    for field, got, want in zip(ref_state._fields, new_state, ref_state):
        assert_close(got, want, rel=1e-5, atol=1e-4, what=f"step state.{field} seed={seed}")
    if not inplace:
        for got, want in zip(state, before):
            assert torch.equal(got, want), "based_step(inplace=False) changed its input state"
    else:
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(state, new_state))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_then_steps_equals_long_prefill(dtype, seed):
    rng = random.Random(seed)
    b, h, dv = 2, 3, 128
    prefix, steps = rng.randint(1, 200), 5
    q, k, v = _inputs(b, prefix + steps, h, dv, dtype)
    long = based.parallel_based(q, k, v)
    _, state = based.parallel_based(q[:, :prefix], k[:, :prefix], v[:, :prefix], output_final_state=True)
    outs = []
    for t in range(prefix, prefix + steps):
        o, state = based.based_step(q[:, t], k[:, t], v[:, t], state, inplace=True)
        outs.append(o)
    assert_close(torch.stack(outs, 1), long[:, prefix:], rel=2e-2, atol=3e-2, what=f"steps vs prefill seed={seed}")
    _, long_state = based.parallel_based(q, k, v, output_final_state=True)
    for field, got, want in zip(reference.BasedState._fields, state, long_state):
        assert_close(got, want, rel=1e-2, atol=1e-2 * want.abs().max().item(), what=f"state.{field} seed={seed}")


def test_steps_from_empty_state(seed):
    b, h, dv = 2, 2, 64
    q, k, v = _inputs(b, 6, h, dv, torch.bfloat16)
    state = based.empty_state(b, h, dv, "cuda")
    outs = []
    for t in range(6):
        o, state = based.based_step(q[:, t], k[:, t], v[:, t], state, inplace=True)
        outs.append(o)
    _check_out(torch.stack(outs, 1), reference.based(q, k, v), True, f"from empty seed={seed}")


def test_bad_input_raises_before_launch():
    q, k, v = _inputs(1, 10, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="v head dim"):
        based.parallel_based(q, k, v[..., :48])
    with pytest.raises(TypeError, match="k must have q's dtype"):
        based.parallel_based(q, k.half(), v)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        based.parallel_based(q.cpu(), k, v)
