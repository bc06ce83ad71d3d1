"""GEMM family: tk vs cuBLAS (torch.matmul), bf16, same inputs, same timing."""
from __future__ import annotations

import os

import torch

import tk_backend
from benchlib import Row, copies_to_defeat_l2, selected, time_per_call

# (M, N, K, trans_b): squares, the small-K cases where a persistent overlapped epilogue pays, and
# 4096 tokens through Llama-3-8B's qkv, o and up projections (weights [N, K], as nn.Linear holds them).
CASES = [
    (4096, 4096, 4096, False), (8192, 8192, 8192, False),
    (4096, 4096, 64, False), (4096, 4096, 128, False), (4096, 4096, 256, False), (4096, 4096, 1024, False),
    (8192, 8192, 1024, False),
    (4096, 6144, 4096, True), (4096, 4096, 4096, True), (4096, 14336, 4096, True),
]


def case_name(m: int, n: int, k: int, trans_b: bool) -> str:
    return f"{m}x{n}x{k}" + ("_nt" if trans_b else "")


def run(quick: bool = False) -> list[Row]:
    """All cases; TK_GEMM_CASES=4096x4096x64,... (case names): those alone (knob sweeps, scripts/tune_gemm.py)."""
    only = [c for c in os.environ.get("TK_GEMM_CASES", "").split(",") if c]
    cases = [c for c in CASES if not only or case_name(*c) in only]
    if only and len(cases) != len(only):
        raise SystemExit(f"TK_GEMM_CASES names cases this family does not have: {only}")
    rows = []
    for m, n, k, trans_b in cases[:3] if quick else cases:
        per_set = 2 * (m * k + k * n + m * n)
        sets = copies_to_defeat_l2(per_set)
        a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        b = [torch.randn((n, k) if trans_b else (k, n), device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        c = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        impls = {
            "tk": lambda i: tk_backend.gemm(a[i], b[i], trans_b=trans_b, out=c[i]),
            "cublas": lambda i: torch.matmul(a[i], b[i].T if trans_b else b[i], out=c[i]),
        }
        for name, call in selected(impls).items():
            ms = time_per_call(call, sets)
            rows.append(Row("gemm", case_name(m, n, k, trans_b), name, ms, tflops=2 * m * n * k / ms / 1e9))
        del a, b, c
        torch.cuda.empty_cache()
    return rows
