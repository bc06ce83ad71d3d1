"""Pure-PyTorch references for every op, computed in float32 (or float64) on upcast inputs."""
from __future__ import annotations

import torch


def gemm(a: torch.Tensor, b: torch.Tensor, trans_b: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bb = b.to(dtype)
    return a.to(dtype) @ (bb.T if trans_b else bb)
