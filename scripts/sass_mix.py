"""Instruction mix of a kernel from ncu's source page (scripts/ncu_pair.py --sass writes $OUT/ncu/sass_*.csv; CPU).

    python3 scripts/sass_mix.py PAGE.csv [PAGE.csv ...]   # one column per page

For each page: the warp instructions executed, by class (wgmma issue and waits, mbarrier, uniform datapath, the
softmax's float ops, ...), each with its share of the instructions and of the stall samples; then the code regions
by execution count (instructions executed the same number of times belong to one loop or one per-task block), the
largest first, with their size in instructions and their share of the samples. Instruction counts are comparable
across pages of the same inputs (tk vs FA3); sample counts are not (ncu picks the sampling interval per run), hence
shares. A TRYWAIT executed far more often than the arrive it waits for is a spinning wait.
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

from ncu_pair import count, source_rows  # scripts/ncu_pair.py, beside this file

SOFTMAX_FLOAT = {"FFMA", "FMUL", "FADD", "FSETP", "FSEL", "F2FP", "FMNMX", "MUFU"}
INTEGER = {"ISETP", "IMAD", "IADD3", "LOP3", "SHF", "LEA", "SEL", "MOV", "S2R", "S2UR", "R2UR", "PRMT", "IMNMX",
           "VIADDMNMX", "VIMNMX", "VIADD", "CS2R", "PLOP3", "P2R", "R2P", "I2F", "F2I", "IABS", "FLO", "POPC", "I2FP",
           "F2IP", "SHFL", "VOTE", "VOTEU", "REDUX", "ELECT"}
CONTROL = {"BRA", "EXIT", "BSSY", "BSYNC", "CALL", "RET", "NOP", "YIELD", "BMOV", "NANOSLEEP"}


def load(page: Path) -> list[dict]:
    return [{"src": r["Source"].strip(), "samples": count(r, "Warp Stall Sampling (All Samples)"),
             "executed": count(r, "Instructions Executed")} for r in source_rows(page.read_text())]


def opcode(src: str) -> str:
    words = src.split()
    return (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "?")


def kind(op: str) -> str:
    base = op.split(".")[0]
    if base == "HGMMA":
        return "wgmma issue"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "wgmma wait"
    if op.startswith("WARPGROUP.ARRIVE") or base in ("WARPSYNC", "BAR"):
        return "barriers"
    if base == "SYNCS":
        return "mbarrier"
    if base.startswith("UTMA") or base == "UBLKCP":
        return "tma"
    if base in SOFTMAX_FLOAT:
        return "float " + base
    if base[0] == "U":
        return "uniform"
    if base in INTEGER:
        return "integer / move"
    if base in CONTROL:
        return "control"
    return "memory / other"


def mix(rows: list[dict]) -> tuple[float, dict[str, list[float]]]:
    total = sum(r["executed"] for r in rows) or 1.0
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        k = by_kind[kind(opcode(r["src"]))]
        k[0] += r["executed"]
        k[1] += r["samples"]
    return total, by_kind


def regions(rows: list[dict], top: int = 6) -> list[str]:
    samples = sum(r["samples"] for r in rows) or 1.0
    groups: dict[float, list[dict]] = collections.defaultdict(list)
    for r in rows:
        if r["executed"] > 0:
            groups[r["executed"]].append(r)
    ranked = sorted(groups.items(), key=lambda g: -g[0] * len(g[1]))[:top]
    return [f"  {count:>12,.0f} x {len(body):4d} instructions = {count * len(body) / 1e6:8.2f} M, "
            f"{100 * sum(r['samples'] for r in body) / samples:5.1f}% of samples" for count, body in ranked]


def main() -> int:
    pages = [Path(p) for p in sys.argv[1:]]
    if not pages:
        print(__doc__)
        return 2
    loaded = {p: load(p) for p in pages}
    mixes = {p: mix(rows) for p, rows in loaded.items()}
    kinds = sorted({k for _, by in mixes.values() for k in by}, key=lambda k: -max(
        by[k][0] for _, by in mixes.values() if k in by))
    width = 34
    print(f"{'':18s}" + "".join(f"{p.stem.removeprefix('sass_')[:width]:>{width}s}" for p in pages))
    print(f"{'executed (M)':18s}" + "".join(f"{total / 1e6:>{width}.2f}" for total, _ in mixes.values()))
    for k in kinds:
        cells = []
        for total, by in mixes.values():
            executed, sampled = by.get(k, [0.0, 0.0])
            share = sum(v[1] for v in by.values()) or 1.0
            cells.append(f"{executed / 1e6:9.2f} M {100 * executed / total:5.1f}% i {100 * sampled / share:5.1f}% s")
        print(f"{k:18s}" + "".join(f"{c:>{width}s}" for c in cells))
    for p, rows in loaded.items():
        print(f"{p.stem}: largest regions (executions x size)")
        print("\n".join(regions(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
