"""Based: validation (every bad input raises a clear error naming the argument, before any launch), fake
shapes, and the reference's agreement with fla-core 0.6.0's definition. Needs no GPU and no kernels."""
from __future__ import annotations

import pytest
import torch

from tk_backend import based, reference
from tests.accuracy import assert_close

META = dict(device="meta", dtype=torch.bfloat16)


def _qkv(b=2, n=100, h=3, dv=64, **kw):
    opts = {**META, **kw}
    return torch.empty(b, n, h, 16, **opts), torch.empty(b, n, h, 16, **opts), torch.empty(b, n, h, dv, **opts)


def _state(b=2, h=3, dv=64, device="meta"):
    w = dv + 1
    return reference.BasedState(torch.empty(b, h, w, device=device), torch.empty(b, h, 16, w, device=device),
                                torch.empty(b, h, 16, 16, w, device=device))


def test_valid_prefill_passes_validation():
    q, k, v = _qkv()
    assert based.validate_prefill(q, k, v, None, True, None, False) == 0.25
    assert based.validate_prefill(q, k, v, 0.5, False, _state(), True) == 0.5


@pytest.mark.parametrize("mutate,exc,message", [
    (lambda q, k, v: (q.float(), k, v), TypeError, "q must be bfloat16 or float16, got float32"),
    (lambda q, k, v: (q, k.half(), v), TypeError, "k must have q's dtype"),
    (lambda q, k, v: (q, k, v.half()), TypeError, "v must have q's dtype"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: (q, k, v[..., :32]), ValueError, "v head dim must be one of"),
    (lambda q, k, v: (q[..., :8], k, v), ValueError, "q must have feature dim 16"),
    (lambda q, k, v: (q, k[..., :8], v), ValueError, "k must have feature dim 16"),
    (lambda q, k, v: (q, k[:, :50], v), ValueError, "k must have shape"),
    (lambda q, k, v: (q, k, v[:1]), ValueError, "v must have shape"),
    (lambda q, k, v: tuple(torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v)), ValueError, "q must be a CUDA tensor"),
    (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor"),
])
def test_bad_prefill_inputs(mutate, exc, message):
    q, k, v = mutate(*_qkv())
    with pytest.raises(exc, match=message):
        based.parallel_based(q, k, v)


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    (dict(scale="big"), ValueError, "scale must be a finite number"),
    (dict(use_norm=1), TypeError, "use_norm must be a bool"),
    (dict(output_final_state="yes"), TypeError, "output_final_state must be a bool"),
    (dict(initial_state=(1, 2)), TypeError, "initial_state must be a BasedState"),
    (dict(initial_state=_state(dv=128)), ValueError, r"initial_state.zeroth must have shape \(2, 3, 65\)"),
    (dict(initial_state=_state(device="cpu")), ValueError, "initial_state.zeroth must be a CUDA tensor"),
])
def test_bad_prefill_options(kwargs, exc, message):
    q, k, v = _qkv()
    with pytest.raises(exc, match=message):
        based.parallel_based(q, k, v, **kwargs)


def test_bad_state_dtype():
    q, k, v = _qkv()
    s = _state()
    bad = s._replace(second=s.second.double())
    with pytest.raises(TypeError, match="initial_state.second must be float32"):
        based.parallel_based(q, k, v, initial_state=bad)


@pytest.mark.parametrize("mutate,exc,message", [
    (lambda q, k, v, s: (q[:, :, None], k, v, s), ValueError, "q must have 3 dimensions"),
    (lambda q, k, v, s: (q, k, v[:, :, :48], s), ValueError, "v head dim must be one of"),
    (lambda q, k, v, s: (q, k, v, s._replace(first=s.first[:, :, :8])), ValueError, "state.first must have shape"),
    (lambda q, k, v, s: (q, k, v, None), TypeError, "state must be a BasedState"),
    (lambda q, k, v, s: (q, k.half(), v, s), TypeError, "k must have q's dtype"),
])
def test_bad_step_inputs(mutate, exc, message):
    q, k, v = (torch.empty(2, 3, d, **META) for d in (16, 16, 64))
    args = mutate(q, k, v, _state())
    with pytest.raises(exc, match=message):
        based.based_step(*args)


def test_step_inplace_must_be_bool():
    q, k, v = (torch.empty(2, 3, d, **META) for d in (16, 16, 64))
    with pytest.raises(TypeError, match="inplace must be a bool"):
        based.based_step(q, k, v, _state(), inplace="no")


def test_fake_shapes():
    q, k, v = _qkv(dv=128)
    o = torch.ops.tk.based_prefill(q, k, v, 0.25, True, 1e-6, None, None, None, None, None, None)
    assert o.shape == (2, 100, 3, 128) and o.dtype == torch.bfloat16
    s = _state(dv=128)
    o = torch.ops.tk.based_step(q[:, 0], k[:, 0], v[:, 0], *s, 0.25, True, 1e-6)
    assert o.shape == (2, 3, 128)


def _fla_based(q, k, v, scale, use_norm):
    """fla-core 0.6.0's parallel_based written out: q scaled (in its dtype) then 1 + s + s^2/2, causal, eps 1e-6."""
    qs = (q * scale).to(q.dtype).float()
    s = torch.einsum("bihd,bjhd->bhij", qs, k.float())
    s = 1 + s + 0.5 * s * s
    n = q.shape[1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), 0.0)
    o = torch.einsum("bhij,bjhd->bihd", s, v.float())
    z = s.sum(-1).transpose(1, 2)
    return o / (z[..., None] + 1e-6) if use_norm else o


@pytest.mark.parametrize("use_norm", [True, False])
def test_reference_matches_fla_definition(use_norm):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 37, 3, d) for d in (16, 16, 64))
    ref = reference.based(q, k, v, use_norm=use_norm)
    assert_close(ref, _fla_based(q, k, v, 16**-0.5, use_norm), rel=1e-5, atol=1e-5, what="reference vs FLA")
    assert based.EPS == 1e-6 and based.FEATURE_DIM**-0.5 == 0.25


def test_reference_state_chaining_with_initial_state():
    # prefill(a) then prefill(b from a's state) gives the state of prefill(a + b): the contract of initial_state
    torch.manual_seed(1)
    k, v = torch.randn(2, 50, 3, 16), torch.randn(2, 50, 3, 64)
    whole = reference.based_prefill_state(k, v)
    a, b = reference.based_prefill_state(k[:, :20], v[:, :20]), reference.based_prefill_state(k[:, 20:], v[:, 20:])
    for x, y, z in zip(a, b, whole):
        assert_close(x + y, z, rel=1e-5, atol=1e-4, what="moments add")


def test_empty_state_layout():
    s = based.empty_state(2, 3, 64, "cpu")
    assert s.zeroth.shape == (2, 3, 65) and s.first.shape == (2, 3, 16, 65) and s.second.shape == (2, 3, 16, 16, 65)
    assert all(t.dtype == torch.float32 and t.is_contiguous() and not t.any() for t in s)
