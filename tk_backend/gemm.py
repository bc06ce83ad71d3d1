"""GEMM: C = A @ B or A @ B^T, bf16/fp16 in, fp32 accumulate, same dtype out (torch.ops.tk.gemm)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tk_backend import _checks
from tk_backend._library import lib, require_kernels

lib.define("gemm(Tensor a, Tensor b, bool trans_b=False) -> Tensor")
lib.define("gemm_out(Tensor a, Tensor b, bool trans_b, Tensor(a!) out) -> ()")


@torch.library.register_fake("tk::gemm")
def _gemm_fake(a: torch.Tensor, b: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0] if trans_b else b.shape[1]))


@torch.library.register_fake("tk::gemm_out")
def _gemm_out_fake(a: torch.Tensor, b: torch.Tensor, trans_b: bool, out: torch.Tensor) -> None:
    return None


def _round8(x: int) -> int:
    return (x + 7) // 8 * 8


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t as a row-major tensor the copy engine can read, zero-padded to rows x cols if needed."""
    if t.shape == (rows, cols) and _checks.tma_ready(t):
        return t
    if t.shape == (rows, cols):
        t = t.contiguous()
        if _checks.tma_ready(t):
            return t
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def validate(a: object, b: object, trans_b: bool, out: object | None) -> tuple[int, int, int]:
    a = _checks.tensor(a, "a", dtypes=_checks.HALF_TYPES, ndim=2)
    b = _checks.tensor(b, "b", dtypes=_checks.HALF_TYPES, ndim=2)
    _checks.same_dtype(b, a, "b", "a")
    _checks.same_device(b, a, "b", "a")
    m, k = a.shape
    n, kb = (b.shape[0], b.shape[1]) if trans_b else (b.shape[1], b.shape[0])
    if kb != k:
        layout = "[N, K] (trans_b=True)" if trans_b else "[K, N]"
        raise ValueError(f"b must be {layout} with K = a.shape[1] = {k}, got b of shape {tuple(b.shape)}")
    if min(m, n, k) < 1:
        raise ValueError(f"gemm needs M, N, K >= 1, got M={m}, N={n}, K={k}")
    if out is not None:
        out = _checks.tensor(out, "out", ndim=2)
        _checks.same_dtype(out, a, "out", "a")
        _checks.same_device(out, a, "out", "a")
        _checks.shape(out, "out", (m, n))
    return m, n, k


def gemm(a: torch.Tensor, b: torch.Tensor, trans_b: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """C = a @ b (b is [K, N]) or a @ b.T (trans_b=True, b is [N, K], as nn.Linear weights).

    Any M, N, K >= 1. Strided inputs are used in place when the copy engine can address them (unit inner
    stride, 16-byte aligned rows); otherwise, and when K or N is not a multiple of 8, operands are
    zero-padded copies (exact: the padding contributes zeros).
    """
    m, n, k = validate(a, b, trans_b, out)
    require_kernels(a)
    k8, n8 = _round8(k), _round8(n)
    a = _padded(a, m, k8)
    b = _padded(b, n8, k8) if trans_b else _padded(b, k8, n8)
    if out is not None and n8 == n and _checks.tma_ready(out):
        torch.ops.tk.gemm_out(a, b, trans_b, out)
        return out
    c = torch.ops.tk.gemm(a, b, trans_b)
    if n8 != n:
        c = c[:, :n].contiguous()
    if out is not None:
        out.copy_(c)
        return out
    return c
