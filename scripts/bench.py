"""The one benchmark entry point: `python scripts/bench.py [--family gemm ...]`.

Times tk and its peers in the same process on the same inputs (../shared/BENCH.md), merges the rows of
the families that ran into bench/results/h200.json (other families' rows are kept), and prints a table
whose last column is tk / best peer.
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchlib import ROOT, impls_subset, merge_results, print_table  # noqa: E402

FAMILIES = {
    "gemm": "benches.gemm", "attn_prefill": "benches.attention", "attn_decode": "benches.decode",
    "based": "benches.based", "mamba2_ssd": "benches.mamba2", "serve": "benches.serve",
}


def draw_picture(results: pathlib.Path) -> None:
    """results' picture beside it (h200.json -> h200.png), where matplotlib is installed (the GPU host may lack it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"not drawn: {results.with_suffix('.png')} (matplotlib is not installed)")
        return
    from plot_results import plot

    try:
        print(f"drew {plot(results, results.with_suffix('.png'))}")
    except ValueError as e:  # e.g. a tk-only run (scripts/ab.py's, no peer present): the rows still count
        print(f"not drawn: {e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="repeatable; default: all")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "h200.json")
    parser.add_argument("--quick", action="store_true", help="a few cases per family (smoke run)")
    parser.add_argument("--no-picture", action="store_true", help="write --out without drawing its picture "
                        "(scripts/ab.py's runs: each file brought back from the device costs one of a call's few)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        print(f"bench.py measures Hopper (sm_90) kernels and needs an H100/H200; found: {found}.", file=sys.stderr)
        return 2
    families = args.family or list(FAMILIES)
    rows = []
    for fam in families:
        rows += importlib.import_module(FAMILIES[fam]).run(quick=args.quick)
    default_out = args.out == parser.get_default("out")
    if impls_subset() and default_out:
        print(f"not written to {args.out}: TK_BENCH_IMPLS times a subset of the impls, and the table keeps "
              "every case's tk and peers from one run")
    elif not args.quick:
        merge_results(args.out, rows)
        print(f"wrote {args.out}")
        if not args.no_picture:
            draw_picture(args.out)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
