"""Run one dense prefill shape a few times, tk and (if importable) FA3, for ncu or the torch profiler.

    python scripts/profile_prefill.py B H N D [--causal] [--iters N] [--impl tk|fa3|both]

Under ncu, e.g. (the tk kernel is kittens::lcsf::kernel<attn_prefill<...>>, FA3's has "flash" in its name):
    ncu --set full -k regex:attn_prefill -s 3 -c 1 -o $OUT/tk python3 scripts/profile_prefill.py 16 16 4096 128
    ncu --set full -k regex:flash -s 3 -c 1 -o $OUT/fa3 python3 scripts/profile_prefill.py 16 16 4096 128 --impl fa3
Without ncu it prints each impl's per-kernel CUDA time (torch profiler).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tk_backend  # noqa: E402
from benches.attention import _fa3  # noqa: E402  (the bench's FA3 import: flash_attn_interface)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs=4, type=int, help="B H N D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--impl", choices=["tk", "fa3", "both"], default="tk")
    args = ap.parse_args()
    b, h, n, d = args.shape
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    impls = {"tk": lambda q, k, v, causal: tk_backend.flash_attn_func(q, k, v, causal=causal)}
    if args.impl in ("fa3", "both"):
        fa3 = _fa3()
        if fa3 is None:
            raise SystemExit("FA3 (flash_attn_interface) is not importable")
        impls["fa3"] = lambda q, k, v, causal: fa3.flash_attn_func(q, k, v, causal=causal)
    if args.impl == "fa3":
        impls.pop("tk")
    for name, fn in impls.items():
        for _ in range(2):
            fn(q, k, v, args.causal)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn(q, k, v, args.causal)
            torch.cuda.synchronize()
        print(f"== {name}: B={b} H={h} N={n} D={d} causal={args.causal}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=5))


if __name__ == "__main__":
    main()
