"""Draw bench/results/h200.png from bench/results/h200.json: tk / best peer, one bar a case, one panel a family.

    python3 scripts/plot_results.py [--results bench/results/h200.json] [--out bench/results/h200.png]

A bar is tk's speed over the fastest peer measured on the same case (> 1: tk is faster), labelled with that
peer's name. "Fastest" is the lowest median_ms, or the highest tok_s where the case's rows carry throughput
(the serve family). A case without a tk row or without a peer has no bar. scripts/bench.py calls `plot` after
it writes the results, when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import json
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Panels in reading order, as two columns of about the same height.
COLUMNS = (("gemm", "attn_prefill", "based"), ("attn_decode", "mamba2_ssd", "serve"))
FASTER, SLOWER = "#3a7d44", "#c0504d"


@dataclass(frozen=True)
class CaseRatio:
    kernel: str
    case: str
    peer: str  # the fastest peer of the case
    peers: tuple[str, ...]  # every peer measured on it
    ratio: float  # tk's speed / that peer's (> 1: tk is faster)
    commit: str


def _speed(row: dict, by_throughput: bool) -> float:
    return row["tok_s"] if by_throughput else 1.0 / row["median_ms"]


def best_peer(impls: dict[str, dict]) -> tuple[str, float] | None:
    """(fastest peer, tk / that peer) of one case's rows keyed by impl; None without tk or without a peer."""
    peers = {name: row for name, row in impls.items() if name != "tk"}
    if "tk" not in impls or not peers:
        return None
    by_throughput = all("tok_s" in row for row in impls.values())
    name = max(peers, key=lambda n: _speed(peers[n], by_throughput))
    return name, _speed(impls["tk"], by_throughput) / _speed(peers[name], by_throughput)


def case_ratios(doc: dict) -> dict[str, list[CaseRatio]]:
    """Every case of a results document with its best peer, grouped by family, cases in file order."""
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for row in doc.get("results", []):
        cases.setdefault((row["kernel"], row["case"]), {})[row["impl"]] = row
    families: dict[str, list[CaseRatio]] = {}
    for (kernel, case), impls in cases.items():
        best = best_peer(impls)
        if best is None:
            continue
        commit = impls["tk"].get("commit", doc.get("commit", "unknown"))
        peers = tuple(name for name in impls if name != "tk")
        families.setdefault(kernel, []).append(CaseRatio(kernel, case, best[0], peers, best[1], commit))
    return families


def _columns(families: dict[str, list[CaseRatio]]) -> list[list[str]]:
    """COLUMNS without absent families; a family not in COLUMNS goes to the shorter column."""
    columns = [[f for f in col if f in families] for col in COLUMNS]
    for fam in families:
        if not any(fam in col for col in columns):
            min(columns, key=lambda col: sum(len(families[f]) + 3 for f in col)).append(fam)
    return [col for col in columns if col]


def plot(results_path: pathlib.Path | str, png_path: pathlib.Path | str) -> pathlib.Path:
    """Draw results_path's tk / best peer ratios into png_path (matplotlib, no display needed)."""
    from matplotlib.figure import Figure

    doc = json.loads(pathlib.Path(results_path).read_text())
    families = case_ratios(doc)
    if not families:
        raise ValueError(f"{results_path} has no case with both a tk row and a peer row")
    columns = _columns(families)
    slots = [[len(families[f]) + 3 for f in col] for col in columns]  # bars + title and axis room
    fig = Figure(figsize=(8.5 * len(columns), 0.2 * max(map(sum, slots)) + 1.2), layout="constrained")
    commits = sorted({r.commit[:7] for rows in families.values() for r in rows})
    fig.suptitle(f"tk speed / fastest peer's, same run, {doc.get('device', 'GPU')} ({doc.get('date', '')[:10]}); "
                 f"commits {', '.join(commits)}\n> 1: tk is faster; each bar names its peer", fontsize=10)
    for subfig, col, heights in zip(fig.subfigures(1, len(columns)) if len(columns) > 1 else [fig],
                                    columns, slots):
        for ax, fam in zip(subfig.subplots(len(col), 1, height_ratios=heights, squeeze=False)[:, 0], col):
            _panel(ax, fam, families[fam])
    png_path = pathlib.Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    return png_path


def _panel(ax, family: str, rows: list[CaseRatio]) -> None:
    y = range(len(rows))
    ratios = [r.ratio for r in rows]
    ax.barh(y, ratios, height=0.7, color=[FASTER if x >= 1 else SLOWER for x in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(y), [r.case for r in rows], fontsize=6.5)
    ax.invert_yaxis()
    top = max(ratios + [1.0])
    ax.set_xlim(0, top * 1.22)
    for i, r in enumerate(rows):
        ax.text(r.ratio + top * 0.01, i, f"{r.ratio:.2f} {r.peer}", va="center", fontsize=6.5)
    commits = ", ".join(dict.fromkeys(r.commit[:7] for r in rows))
    peers = ", ".join(dict.fromkeys(p for r in rows for p in r.peers))
    ax.set_title(f"{family} at {commits}; peers measured: {peers}", fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=pathlib.Path, default=ROOT / "bench" / "results" / "h200.json")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "h200.png")
    args = parser.parse_args()
    print(f"drew {plot(args.results, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
