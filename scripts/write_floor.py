"""The write floor under the short-K GEMMs: how fast the H200 writes an M x N bf16 output at all.

    python3 scripts/write_floor.py [M N]     # default 4096 4096

Times, the bench's way (benchlib.time_per_call: rotated sets, CUDA-graph replay), a plain fill of the output
(torch's fill_: writes only), and tk's GEMM and cuBLAS at K = 16 ... 1024 on the same output size. Each line gives
the time and the output's write rate, so a short-K GEMM reads off against the fill it can at best match: at K=64
the 4096 x 4096 output (32 MiB) is ~32x the inputs' bytes.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tk_backend  # noqa: E402
from benchlib import copies_to_defeat_l2, time_per_call  # noqa: E402


def main() -> int:
    m, n = (int(x) for x in sys.argv[1:3]) if len(sys.argv) >= 3 else (4096, 4096)
    out_bytes = 2 * m * n
    sets = copies_to_defeat_l2(out_bytes)
    c = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    lines = []

    def report(label: str, ms: float) -> None:
        lines.append(f"{label:<28} {ms * 1e3:9.2f} us  {out_bytes / ms / 1e9:6.2f} TB/s of output")

    report("fill_", time_per_call(lambda i: c[i].fill_(1.0), sets))
    for k in (16, 32, 64, 128, 256, 1024):
        a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        tk_ms = time_per_call(lambda i: tk_backend.gemm(a[i], b[i], out=c[i]), sets)
        cublas_ms = time_per_call(lambda i: torch.matmul(a[i], b[i], out=c[i]), sets)
        report(f"tk gemm K={k}", tk_ms)
        report(f"cublas K={k} (tk/cublas {cublas_ms / tk_ms:.3f})", cublas_ms)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
