"""GEMM input validation and fake (meta) implementation: no GPU needed."""
from __future__ import annotations

import pytest
import torch

import tk_backend


def _t(*shape, dtype=torch.bfloat16, device="meta"):
    return torch.empty(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "a,b,kwargs,exc,match",
    [
        (_t(4, 8, dtype=torch.float32), _t(8, 8), {}, TypeError, "a must be bfloat16 or float16, got float32"),
        (_t(4, 8), _t(8, 8, dtype=torch.float16), {}, TypeError, "b must have a's dtype"),
        (_t(4, 8, 2), _t(8, 8), {}, ValueError, "a must have 2 dimensions, got 3"),
        (_t(4, 8), _t(8), {}, ValueError, "b must have 2 dimensions, got 1"),
        (_t(4, 8), _t(9, 8), {}, ValueError, r"b must be \[K, N\] with K = a.shape\[1\] = 8"),
        (_t(4, 8), _t(8, 9), {"trans_b": True}, ValueError, r"b must be \[N, K\] \(trans_b=True\)"),
        (_t(0, 8), _t(8, 8), {}, ValueError, "M, N, K >= 1"),
        (_t(4, 8, device="cpu"), _t(8, 8, device="cpu"), {}, ValueError, "a must be a CUDA tensor, got device cpu"),
        ([[1.0]], _t(8, 8), {}, TypeError, "a must be a torch.Tensor, got list"),
    ],
)
def test_gemm_rejects_bad_input(a, b, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tk_backend.gemm(a, b, **kwargs)


def test_gemm_rejects_bad_out():
    with pytest.raises(ValueError, match=r"out must have shape \(4, 8\), got \(4, 9\)"):
        tk_backend.gemm(_t(4, 8), _t(8, 8), out=_t(4, 9))
    with pytest.raises(TypeError, match="out must have a's dtype"):
        tk_backend.gemm(_t(4, 8), _t(8, 8), out=_t(4, 8, dtype=torch.float16))


def test_gemm_fake_shapes():
    out = torch.ops.tk.gemm(_t(5, 24), _t(40, 24), True)
    assert out.shape == (5, 40) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out = torch.ops.tk.gemm(_t(5, 24), _t(24, 16), False)
    assert out.shape == (5, 16)
