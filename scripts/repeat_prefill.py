"""How much one machine's attn_prefill figures move from round to round (GPU).

The bench's dense cases timed again and again with the bench's own timing and impls (scripts/benches/attention.py);
each round's tk time and peer / tk ratios are printed, then their spread (min / median / max). For reading a bench's
near-miss against the noise before calling it a regression or a win.

    python3 scripts/repeat_prefill.py --rounds 5 --cases 64:1024:causal,64:1024:full   # head dim : length : mask
"""
from __future__ import annotations

import argparse
import statistics

from dense_cases import attention, dense


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="64:1024:causal,64:1024:full")
    args = ap.parse_args()
    ratios: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for spec in args.cases.split(","):
            rows = attention.measure(*dense(spec))
            ms = {row.impl: row.median_ms for row in rows}
            case = rows[0].case
            line = ratios.setdefault(case, {})
            line.setdefault("tk ms", []).append(ms["tk"])
            for peer, t in ms.items():
                if peer != "tk":
                    line.setdefault(f"{peer}/tk", []).append(t / ms["tk"])
            print(f"round {r} {case}: " + "  ".join(f"{k} {v[-1]:.4f}" for k, v in line.items()), flush=True)
    print("spread over rounds (min / median / max):")
    for case, line in ratios.items():
        print(f"  {case}: " + "  ".join(f"{k} {min(v):.4f} / {statistics.median(v):.4f} / {max(v):.4f}"
                                      for k, v in line.items()))


if __name__ == "__main__":
    main()
