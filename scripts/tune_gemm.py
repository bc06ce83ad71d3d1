"""Sweep the GEMM launch knobs (ring depth, release lag, raster width) on the GPU.

    python3 scripts/tune_gemm.py [s4l1g16 s3l0g8 ...] [--rounds N]   # labels: stages, lag, group rows
    TK_GEMM_CASES=4096x4096x64,4096x4096x256 python3 scripts/tune_gemm.py ...   # some cases only

Each variant runs the gemm benchmark family in its own process (the knobs are read once per process from
TK_GEMM_STAGES, TK_GEMM_LAG, TK_GEMM_GROUP_ROWS) and the table shows tk / cuBLAS per case and variant.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ["s4l1g16", "s4l0g16", "s3l1g16", "s3l0g16", "s4l1g8"]


def parse(label: str) -> dict[str, int]:
    """'s3l0g8' -> TK_GEMM_STAGES=3, TK_GEMM_LAG=0, TK_GEMM_GROUP_ROWS=8."""
    found = re.fullmatch(r"s(\d+)l(\d+)g(\d+)", label)
    if not found:
        raise SystemExit(f"tune_gemm: variant labels look like s4l1g16, not {label!r}")
    s, lag, g = map(int, found.groups())
    return dict(TK_GEMM_STAGES=s, TK_GEMM_LAG=lag, TK_GEMM_GROUP_ROWS=g)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", help="labels such as s4l1g16 (default: a fixed set)")
    parser.add_argument("--rounds", type=int, default=1, help="time every variant N times, interleaved; "
                        "the table shows each ratio's median over the rounds")
    args = parser.parse_args()
    labels = args.variants or VARIANTS
    knobs = {label: parse(label) for label in labels}
    ratios: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for label in labels:
            out = pathlib.Path(tempfile.mkdtemp()) / "gemm.json"
            env = {**os.environ, **{k: str(x) for k, x in knobs[label].items()}}
            subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--family", "gemm", "--out", str(out)],
                           env=env, check=True, stdout=subprocess.DEVNULL)
            rows = json.loads(out.read_text())["results"]
            by = {(r["case"], r["impl"]): r["tflops"] for r in rows}
            for case in dict.fromkeys(r["case"] for r in rows):
                ratios.setdefault(case, {}).setdefault(label, []).append(by[(case, "tk")] / by[(case, "cublas")])
    print(f"{'tk/cublas':<22}" + "".join(f"{l:>12}" for l in labels))
    for case, by_label in ratios.items():
        print(f"{case:<22}" + "".join(f"{statistics.median(by_label[l]):>12.3f}" for l in labels))
    if args.rounds > 1:
        print("ranges over the rounds:")
        for case, by_label in ratios.items():
            print(f"{case:<22}" + "".join(f"{max(by_label[l]) - min(by_label[l]):>12.3f}" for l in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
