"""Comparison helpers: relative Frobenius error plus an element bound; NaN never passes."""
from __future__ import annotations

import torch


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, rel: float, atol: float, what: str = "") -> None:
    out32, ref32 = out.float(), ref.float()
    assert out32.shape == ref32.shape, f"{what}: shape {tuple(out32.shape)} != {tuple(ref32.shape)}"
    assert not torch.isnan(out32).any(), f"{what}: output has NaN (unwritten or invalid elements)"
    err = (out32 - ref32).norm() / ref32.norm().clamp_min(1e-30)
    assert err <= rel, f"{what}: relative error {err:.3e} > {rel:.1e}"
    worst = (out32 - ref32).abs() - rel * ref32.abs()
    idx = int(worst.argmax())
    assert worst.flatten()[idx] <= atol, (
        f"{what}: element {idx} is {out32.flatten()[idx].item():.5f}, reference {ref32.flatten()[idx].item():.5f}"
    )
