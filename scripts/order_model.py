"""A model of attn_prefill's persistent task order, for judging a new order before it reaches a GPU (CPU).

How unevenly the stride order spreads a causal prefill's tasks over the CTAs, beside zigzag (odd waves reversed,
attn_prefill's task order at D=64) and claimed tasks (greedy: each task goes to the CTA that frees first). A task
costs its key tiles plus `--overhead` tiles; the figure printed is the busiest CTA's cost over the mean (1.0: even).
It models neither L2 nor the CTAs' drift in time, only the static spread, so it is a guide only: see
docs/findings/prefill.md#prefill-zigzag for where it agreed with ncu and where it did not.

    python3 scripts/order_model.py                       # D=64 (three consumers), the bench's causal lengths
    python3 scripts/order_model.py --d 128 --bq 128 --heads 16 --lengths 1024
"""
from __future__ import annotations

import argparse
import heapq
import math

L2_BYTES = 50 * 2**20  # the H200's L2 as attention.cu's heads_per_l2_group sees it (cudaDevAttrL2CacheSize)


def tasks(n: int, batch: int, heads: int, bq: int, kv: int, heads_per_group: int) -> list[int]:
    """Key tiles of each task, in task-id order (attn_prefill::task: groups of heads, latest blocks first, a
    sequence's blocks aligned to its end in 64-row steps)."""
    q_blocks = math.ceil(n / bq)
    pairs = batch * heads
    per_group = heads_per_group * q_blocks
    out = []
    for i in range(q_blocks * pairs):
        group, in_group = divmod(i, per_group)
        group_heads = min(heads_per_group, pairs - group * heads_per_group)
        qb = q_blocks - 1 - in_group // group_heads
        row0 = math.ceil(n / 64) * 64 - (q_blocks - qb) * bq
        end = min(n, row0 + bq)
        out.append(math.ceil(end / kv))
    return out


def zigzag(order: list[int], ctas: int) -> list[int]:
    """Odd waves of ctas ids reversed (complete waves only), as attn_prefill::task maps an id."""
    out = []
    for i in range(len(order)):
        wave = i // ctas
        j = wave * ctas + ctas - 1 - i % ctas if wave % 2 and (wave + 1) * ctas <= len(order) else i
        out.append(order[j])
    return out


def strided(order: list[int], ctas: int, overhead: float) -> float:
    load = [0.0] * ctas
    for i, tiles in enumerate(order):
        load[i % ctas] += tiles + overhead
    return max(load) / (sum(load) / ctas)


def claimed(order: list[int], ctas: int, overhead: float) -> float:
    free = [(0.0, c) for c in range(ctas)]
    for tiles in order:
        t, c = heapq.heappop(free)
        heapq.heappush(free, (t + tiles + overhead, c))
    return max(t for t, _ in free) / (sum(tiles + overhead for tiles in order) / ctas)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--bq", type=int, default=192, help="query rows a task (64 a consumer)")
    ap.add_argument("--kv", type=int, default=128, help="keys a tile")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=65536, help="batch x length, as the bench's dense cases")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=1.5, help="a task's fixed cost, in tiles")
    args = ap.parse_args()
    print("n      heads/group  stride  zigzag  claimed")
    for n in (int(x) for x in args.lengths.split(",")):
        batch = max(1, args.tokens // n)
        per_group = max(1, min((L2_BYTES // 2) // (n * args.d * 2 * 2), batch * args.heads))
        order = tasks(n, batch, args.heads, args.bq, args.kv, per_group)
        print(f"{n:<6} {per_group:<12} {strided(order, args.ctas, args.overhead):.3f}   "
              f"{strided(zigzag(order, args.ctas), args.ctas, args.overhead):.3f}   "
              f"{claimed(order, args.ctas, args.overhead):.3f}")


if __name__ == "__main__":
    main()
