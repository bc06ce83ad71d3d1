"""Timing and results plumbing for scripts/bench.py (see ../shared/BENCH.md for the protocol).

Every impl of a case is timed the same way: inputs rotated over enough copies to defeat the 60 MB L2,
calls captured once in a CUDA graph and replayed; the figure is the median over replays of the time
per call. Decode cases with a call under ~20 us take the median of 5 interleaved rounds (time_impls).
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

L2_BYTES = 60 * 2**20
ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclass
class Row:
    kernel: str
    case: str
    impl: str
    median_ms: float
    tflops: float | None = None
    tbps: float | None = None
    extra_mib: float | None = None
    note: str | None = None
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        d.update(self.extra)
        return d


def copies_to_defeat_l2(bytes_per_set: int, cap: int = 16) -> int:
    """How many input sets to rotate through so that consecutive calls miss in L2."""
    return max(1, min(cap, -(-2 * L2_BYTES // max(bytes_per_set, 1))))


def time_per_call(call: Callable[[int], object], sets: int, replays: int = 30, target_ms: float = 20.0) -> float:
    """Median milliseconds per call of call(i) (i = input set), timed by CUDA-graph replay."""
    for i in range(sets):  # warm-up: module load, descriptors, allocator
        call(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(sets):
        call(i)
    end.record()
    torch.cuda.synchronize()
    eager_ms = start.elapsed_time(end) / sets
    calls = max(sets, min(200, int(target_ms / max(eager_ms, 1e-3)) // sets * sets or sets))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for j in range(calls):
                call(j % sets)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(min(replays, replays_for(eager_ms * calls))):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


SHORT_CALL_MS = 0.020  # calls under ~20 us move 5-20% run to run (issue 48): they get interleaved rounds
SHORT_CALL_ROUNDS = 5


@dataclass
class Timed:
    """An impl's time for a case: the median over `rounds` interleaved rounds (1 for a long call), with the
    fastest and slowest round."""
    median_ms: float
    min_ms: float
    max_ms: float
    rounds: int

    def extra(self) -> dict:
        """What a results row records beside median_ms (nothing for a single round)."""
        if self.rounds == 1:
            return {}
        return {"rounds": self.rounds, "min_ms": self.min_ms, "max_ms": self.max_ms}


def time_impls(impls: dict[str, Callable[[int], object]], sets: int, timer: Callable | None = None,
               short_ms: float = SHORT_CALL_MS, rounds: int = SHORT_CALL_ROUNDS,
               on_error: Callable[[str, Exception], None] | None = None) -> dict[str, Timed]:
    """Each impl timed once (timer: time_per_call); when any of them is a short call (< short_ms), every impl
    again for rounds - 1 more rounds, interleaved, each round starting one impl later, so that a drift of the
    clock falls on all of them alike. An impl that raises, in any round, is left out (on_error(impl, exc) told
    why)."""
    timer = timer or time_per_call
    times: dict[str, list[float]] = {}

    def attempt(impl: str) -> None:  # one more round of impl; a failure in any round leaves it out
        try:
            times.setdefault(impl, []).append(timer(impls[impl], sets))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run the case
            times.pop(impl, None)
            if on_error:
                on_error(impl, exc)

    for impl in impls:
        attempt(impl)
    if times and min(t[0] for t in times.values()) < short_ms:
        names = list(times)
        for r in range(1, rounds):
            for impl in names[r % len(names):] + names[:r % len(names)]:
                if impl in times:
                    attempt(impl)
    return {impl: Timed(statistics.median(t), min(t), max(t), len(t)) for impl, t in times.items()}


def replays_for(ms_per_call: float) -> int:
    """Fewer replays for long calls: about a second of timing per impl, at least 5 replays."""
    return max(5, min(30, int(1000 / max(ms_per_call, 1e-3))))


def commit_of_tree() -> str:
    """The commit being measured: $TK_COMMIT or .tk_commit (the GPU host has no .git), else git."""
    if os.environ.get("TK_COMMIT"):
        return os.environ["TK_COMMIT"]
    marker = ROOT / ".tk_commit"
    if marker.exists():
        return marker.read_text().strip()
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _only_impls() -> list[str]:
    return [i for i in os.environ.get("TK_BENCH_IMPLS", "").split(",") if i]


def impls_subset() -> bool:
    """Whether $TK_BENCH_IMPLS times a subset of the impls (an A/B's variant run): such a run writes no table and
    skips what only the table needs (the decode read ceiling)."""
    return bool(_only_impls())


def selected(impls: dict) -> dict:
    """The impls to time: all, or those named in $TK_BENCH_IMPLS (comma-separated; e.g. tk for an A/B of tk
    variants, where the peers' times add nothing)."""
    only = _only_impls()
    return {k: v for k, v in impls.items() if not only or k in only}


def merged_rows(old: dict, rows: Sequence[Row], commit: str) -> list[dict]:
    """Replace the rows of the cases that ran (every impl of such a case, so that a case's ratios always come
    from one run); keep every other row, each with the commit it measured."""
    ran = {(r.kernel, r.case) for r in rows}
    kept = [dict(r) for r in old.get("results", []) if (r.get("kernel"), r.get("case")) not in ran]
    for r in kept:
        r.setdefault("commit", old.get("commit", "unknown"))
    return kept + [{**r.as_json(), "commit": commit} for r in rows]


def merge_results(path: pathlib.Path, rows: Sequence[Row]) -> dict:
    """Write path's results with this run's rows merged in (merged_rows)."""
    old = json.loads(path.read_text()) if path.exists() else {"results": []}
    commit = commit_of_tree()
    props = torch.cuda.get_device_properties(0)
    doc = {
        "device": props.name,
        "commit": commit,
        "commit_note": "each row's commit is the tree it measured; 'commit' is the newest run's",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "sms": props.multi_processor_count,
        "results": merged_rows(old, rows, commit),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def print_table(rows: Sequence[Row]) -> None:
    """One line per case: every impl's figure, then tk / best peer (>1 means tk is faster)."""
    cases: dict[tuple[str, str], dict[str, Row]] = {}
    for r in rows:
        cases.setdefault((r.kernel, r.case), {})[r.impl] = r
    print(f"\n{'kernel':<13}{'case':<40}{'impl: metric (ms)':<70}{'tk/best':>8}")
    for (kernel, case), impls in cases.items():
        def metric(r: Row) -> float:
            if r.tflops is not None:
                return r.tflops
            if r.tbps is not None:
                return r.tbps
            return r.extra.get("tok_s", 1.0 / r.median_ms)

        parts = []
        for name, r in impls.items():
            unit = "TF" if r.tflops is not None else "TB/s" if r.tbps is not None else " tok/s" if "tok_s" in r.extra else ""
            parts.append(f"{name}: {metric(r):.3g}{unit} ({r.median_ms:.4g})")
        peers = [metric(r) for n, r in impls.items() if n != "tk"]
        ratio = f"{metric(impls['tk']) / max(peers):.3f}" if "tk" in impls and peers else "-"
        print(f"{kernel:<13}{case:<40}{'  '.join(parts):<70}{ratio:>8}")
