"""Per-tile and per-task cost of the prefill, causal against full masks (GPU).

    python3 scripts/probe_prefill_tiles.py [--fa3] [--d 128 --lengths 256,512,1024]

Times tk (and FA3 with --fa3, when its wheel is importable) at head dim --d (64 or 128), 32 heads, 65536 tokens, at
the --lengths (default 1024, 2048, 4096), and fits time = tasks a CTA x (tiles a task x T + X) by least squares
(residuals printed: a bad fit says the model misses something): T is the time of one 128 x 128 key-query tile, X
the cost of a task. It also times full masks over n / 2 keys beside causal over n (n the longest length): the same
tile work, so what the causal run costs beyond it is the mask, the order and the unequal lengths. Fits it gave:
docs/findings/prefill.md#d128-two-consumer-tile.
"""
from __future__ import annotations

import argparse
import math

import torch

import tk_backend
from benchlib import time_per_call  # scripts/benchlib.py, beside this file

TOKENS, HEADS = 65536, 32
D = 64  # --d


def timed(n: int, causal: bool, fa3=None) -> float:
    b = TOKENS // n
    q, k, v = (torch.randn(b, n, HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if fa3 is None:
        out = torch.empty_like(q)
        return time_per_call(lambda i: tk_backend.flash_attn_func(q, k, v, causal=causal, out=out), 1)
    return time_per_call(lambda i: fa3.flash_attn_func(q, k, v, causal=causal), 1)


def tiles(n: int, bq: int, bk: int, causal: bool) -> tuple[int, float]:
    """Tasks (query blocks x heads) and the mean 128 x 128 tiles a task, for bq x bk tiles."""
    blocks = math.ceil(n / bq)
    per_task = [math.ceil(min(n, (i + 1) * bq) / bk) if causal else math.ceil(n / bk) for i in range(blocks)]
    heads = TOKENS // n * HEADS
    return blocks * heads, sum(per_task) / blocks * (bq * bk) / (128 * 128)


def fit(ms, shapes, ctas: int) -> tuple[float, float, list[float]]:
    """Least squares of us a task = tiles a task x T + X over the lengths; (T, X, relative residuals)."""
    xs = [k for _, k in shapes]
    ys = [t * 1e3 / (tasks / ctas) for t, (tasks, _) in zip(ms, shapes)]  # us a task
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    tile = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    overhead = my - tile * mx
    return tile, overhead, [(tile * x + overhead) / y - 1 for x, y in zip(xs, ys)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fa3", action="store_true")
    parser.add_argument("--d", type=int, default=64, choices=(64, 128))
    parser.add_argument("--lengths", default="1024,2048,4096")
    args = parser.parse_args()
    global D
    D = args.d
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    impls = {"tk": None}
    if args.fa3:
        try:
            import flash_attn_interface as fa3
            impls["fa3"] = fa3
        except ImportError:
            print("no FA3 wheel: tk only")
    # the tile shapes each impl runs (tk: two consumers for D=64 causal up to 4096 keys, three otherwise;
    # FA3: 192 x 128 causal, 192 x 192 full)
    # (D=128: tk two consumers causal up to 1024 keys, three otherwise; FA3 128 x 128 causal, 128 x 176 full)
    shapes = {"tk": {True: (128, 128), False: (192, 128)}, "fa3": {True: (192, 128), False: (192, 192)}}
    if D == 128:
        shapes["fa3"] = {True: (128, 128), False: (128, 176)}
    # tk's causal kernel changes (two consumers -> three) past 4096 keys at D=64, past 1024 at D=128
    lengths = tuple(int(n) for n in args.lengths.split(","))
    for name, mod in impls.items():
        for causal in (True, False):
            bq, bk = shapes[name][causal]
            ms = [timed(n, causal, mod) for n in lengths]
            t, x, residuals = fit(ms, [tiles(n, bq, bk, causal) for n in lengths], ctas)
            print(f"{name} {'causal' if causal else 'full  '} n={' / '.join(map(str, lengths))}: "
                  f"{' / '.join(f'{m:.4f}' for m in ms)} ms; T = {t:.3f} us a 128 x 128 tile, X = {x:.2f} us a "
                  f"task (fit residuals {' / '.join(f'{r:+.3f}' for r in residuals)})")
        n = lengths[-1]  # full masks over n / 2 keys beside causal over n: the same work
        full_half, causal_n = timed(n // 2, False, mod), timed(n, True, mod)
        work = [tasks * per_task for tasks, per_task in
                (tiles(n // 2, *shapes[name][False], False), tiles(n, *shapes[name][True], True))]
        print(f"{name} full n={n // 2} {full_half:.4f} ms, causal n={n} {causal_n:.4f} ms: "
              f"causal / full {causal_n / full_half:.3f} (work ratio {work[1] / work[0]:.3f} in 128 x 128 tiles)")

if __name__ == "__main__":
    main()
