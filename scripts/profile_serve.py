"""Where a serve case's time goes, per attention backend: the torch profiler over one generate() of the case.

    python3 scripts/profile_serve.py [--tp 2] [--case offline_64x128in_1024out] [--impls tk,flash_attn] [--out DIR]

Each backend runs in its own process (the serve bench's model, settings and prompts; one untimed run of the
case first), with vLLM's torch profiler on around a second run. From rank 0's trace it prints, per backend:
the generate() wall time, the GPU's busy time (union of kernel intervals) and its idle time, the kernel time of
attention kernels (ours, FA3's, Triton's) against everything else, the top kernels, and the host's launches
(graph replays vs single kernels: a decode step that is not a full CUDA graph shows as many single launches).
A gap in idle time points at the host (scheduling, metadata building, launch); a gap in attention time at the
kernels.
vLLM's own per-op table (profiler_out_0.txt) and the traces stay under --out.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from benches import serve  # noqa: E402
from serve_demo import vllm_env  # noqa: E402

# Kernel-name fragments of attention kernels: ours (attention.cu, decode.cu), FA3, Triton's unified attention,
# and the KV-cache write, which every backend here shares.
ATTENTION = ("tk::", "attn", "attention", "flash", "decode_", "merge_", "build_schedule", "reshape_and_cache")


def worker(model: str, backend: str, tp: int, case: str, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    llm, vocab = serve.engine(model, backend, tp, profiler_config={
        "profiler": "torch", "torch_profiler_dir": str(out_dir), "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": False, "ignore_frontend": True})
    prompts, params = serve.case_inputs(case, vocab)
    llm.generate(prompts, params, use_tqdm=False)  # warm: this case's shapes, graphs, allocator
    llm.start_profile()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.stop_profile()
    (out_dir / "wall.json").write_text(json.dumps({"seconds": seconds}))


def _rank_traces(out_dir: Path) -> dict[int, Path]:
    """Each rank's newest trace; vLLM names them ..._rankN.<time>.pt.trace.json (one unnamed trace: rank 0)."""
    traces = sorted((p for p in out_dir.rglob("*.json*") if "pt.trace" in p.name), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no torch profiler trace under {out_dir}")
    ranks: dict[int, Path] = {}
    for p in traces:
        rank = re.search(r"rank(\d+)\.", p.name)
        ranks[int(rank.group(1)) if rank else 0] = p
    return dict(sorted(ranks.items()))


def _trace_events(trace: Path) -> dict[str, list[dict]]:
    """A trace's timed events by category (kernel, cuda_runtime, gpu_user_annotation, ...)."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        doc = json.load(f)
    by_category: dict[str, list[dict]] = defaultdict(list)
    for e in doc.get("traceEvents", []):
        if "dur" in e:
            by_category[e.get("cat", "")].append(e)
    return by_category


def _quantiles(values: list[float]) -> list[float]:
    """p10, p50, p90 of values (us)."""
    v = sorted(values)
    return [round(v[min(len(v) - 1, int(q * len(v)))], 1) for q in (0.1, 0.5, 0.9)] if v else []


def summarize(trace: Path, wall_s: float) -> dict:
    events = _trace_events(trace)
    kernels = events["kernel"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # union of the kernel intervals
        if e > end:
            busy += e - max(s, end)
            end = e
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(e["dur"])
    attention = sum(sum(t) for n, t in by_name.items() if any(f in n.lower() for f in ATTENTION))
    total = sum(sum(t) for t in by_name.values())
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    # Graph replays vs single launches on the host: a decode step that is not replayed as a full CUDA graph
    # launches each layer's attention kernels one by one.
    launches: dict[str, int] = defaultdict(int)
    for e in events["cuda_runtime"]:
        if "Launch" in e["name"]:
            launches[e["name"]] += 1
    # vLLM's per-step GPU annotations, execute_context_<prefill tokens>(...)_generation_<decodes>(...): pure
    # decode steps (no prefill tokens) apart from mixed ones.
    steps: dict[str, list[float]] = defaultdict(list)
    for e in events["gpu_user_annotation"]:
        if e["name"].startswith("execute_context_"):
            steps["decode" if e["name"].startswith("execute_context_0(") else "mixed"].append(e["dur"])
    return {"trace": trace.name, "wall_ms": wall_s * 1e3, "kernel_span_ms": span / 1e3,
            "gpu_busy_ms": busy / 1e3, "gpu_idle_ms": (span - busy) / 1e3, "attention_ms": attention / 1e3,
            "other_kernels_ms": (total - attention) / 1e3, "kernels": len(kernels),
            "top": [(n[:90], round(sum(t) / 1e3, 2), len(t), _quantiles(t)) for n, t in top],
            "steps": {k: (len(v), round(sum(v) / 1e3, 1), _quantiles(v)) for k, v in steps.items()},
            "launches": dict(launches)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--backend")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("TK_SERVE_TP", "1")))
    parser.add_argument("--case", default="offline_64x128in_1024out", choices=sorted(serve.CASES))
    parser.add_argument("--impls", default="tk,flash_attn")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "profile_serve")
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.backend, args.tp, args.case, args.out)
        return 0

    model = serve.build_model()
    env = vllm_env()
    report = {}
    for impl in args.impls.split(","):
        out_dir = args.out / f"{impl}_tp{args.tp}_{args.case}"
        command = [sys.executable, __file__, "--worker", "--model", str(model), "--backend", serve.IMPLS[impl],
                   "--tp", str(args.tp), "--case", args.case, "--out", str(out_dir)]
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=serve.STARTUP_TIMEOUT_S + 2 * serve.RUN_TIMEOUT_S)
        if proc.returncode != 0:
            print(f"{impl}: worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            continue
        wall = json.loads((out_dir / "wall.json").read_text())["seconds"]
        report[impl] = {}
        for rank, trace in _rank_traces(out_dir).items():
            report[impl][rank] = summary = summarize(trace, wall)
            print(f"\n== {impl} rank {rank} (tp{args.tp}, {args.case}): wall {summary['wall_ms']:.0f} ms (profiled), "
                  f"kernel span {summary['kernel_span_ms']:.0f} ms, GPU busy {summary['gpu_busy_ms']:.0f} / idle "
                  f"{summary['gpu_idle_ms']:.0f} ms; attention {summary['attention_ms']:.1f} ms, other kernels "
                  f"{summary['other_kernels_ms']:.1f} ms, {summary['kernels']} kernels")
            print(f"   host launches: {summary['launches']}")
            for kind, (count, ms, q) in summary["steps"].items():
                print(f"   {kind} steps: {count}, {ms:.1f} ms on the GPU, p10/p50/p90 {q} us")
            for name, ms, count, q in summary["top"]:
                print(f"   {ms:9.2f} ms  {count:6d} x p10/p50/p90 {q} us  {name}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"summary_tp{args.tp}_{args.case}.json").write_text(json.dumps(report, indent=1))
    return 0 if report else 1


if __name__ == "__main__":
    sys.exit(main())
