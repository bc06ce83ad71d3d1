"""Mamba-2 SSD precision on the GPU: tk's scan and mamba_ssm's Triton scan against the float32 sequential
recurrence (tk_backend.reference), same bf16 inputs, shapes like the tiny vLLM e2e presets. Prints each path's
relative L2 error and max abs error of y and of the final state, so a precision gap between the two paths shows
as a ratio, not as an e2e logprob drift."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benches.mamba2 import _mamba_ssm  # noqa: E402
import tk_backend  # noqa: E402
from tk_backend import reference  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.float(), b.float()
    return f"rel {((a - b).norm() / b.norm()).item():.2e} max {(a - b).abs().max().item():.2e}"


def main() -> None:
    peer = _mamba_ssm()
    torch.manual_seed(0)
    for (l, h, p, g, n, chunk) in [(512, 8, 64, 8, 128, 256), (512, 8, 64, 1, 64, 256), (1000, 16, 64, 1, 128, 64)]:
        dev, dt_ = "cuda", torch.bfloat16
        x = torch.randn(1, l, h, p, device=dev, dtype=dt_)
        dt = torch.randn(1, l, h, device=dev) * 0.5 - 1.0
        A = -torch.rand(h, device=dev) * 2 - 0.1
        B = torch.randn(1, l, g, n, device=dev, dtype=dt_) * 0.3
        C = torch.randn(1, l, g, n, device=dev, dtype=dt_) * 0.3
        D, dt_bias = torch.randn(h, device=dev), torch.randn(h, device=dev) * 0.3
        z = torch.randn_like(x)
        kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        ref_y, ref_s = reference.mamba_chunk_scan(x=x, dt=dt, A=A, B=B, C=C, initial_states=None, **kw)
        y_tk, s_tk = tk_backend.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, return_final_states=True, **kw)
        line = f"l={l} h={h} p={p} g={g} n={n} chunk={chunk}\n  tk        y {rel(y_tk, ref_y)} | state {rel(s_tk, ref_s)}"
        if peer is not None:
            y_m, s_m = peer(x, dt, A, B, C, chunk, return_final_states=True, **kw)
            line += f"\n  mamba_ssm y {rel(y_m, ref_y)} | state {rel(s_m, ref_s)}\n  tk vs mamba_ssm y {rel(y_tk, y_m)}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
