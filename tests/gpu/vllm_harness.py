"""What the vLLM end-to-end tests share: reading prompt logprobs and greedy tokens (or pooled embeddings) out of an
engine (inside a worker process), and comparing two such runs (in the test process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from serve_demo import vllm_env  # noqa: E402,F401  (the environment of the tests' vLLM workers)


def workdir(tmp_path_factory, name: str) -> Path:
    """Where a test's models and engines' results go: under $TK_E2E_WORKDIR if set (kept, so a later run, e.g.
    the next device call after a time limit, resumes with the engines that finished), else a fresh temp dir.
    Skips the test when vLLM is not importable."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vLLM is not importable (GPU host: source /tmp/vllm_site/env.sh)")
    keep = os.environ.get("TK_E2E_WORKDIR")
    if keep:
        path = Path(keep) / name
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp(name)


# Each e2e engine's KV cache (or Mamba state), fixed: the engines of one test run at once (run_workers). The tiny
# test models need far less.
E2E_KV_CACHE_BYTES = 4 << 30


def try_workers(jobs: list[tuple[Path, list[str], dict[str, str]]], cwd: Path, timeout_s: float
                ) -> list[dict | str]:
    """Runs each (out, command, env) whose `out` does not exist yet, all at once, each in its own process, and
    returns per job the results (the JSON its worker wrote to `out`) or, for a worker that failed, a report of the
    failure (its exit status and the end of its log); a worker's stdout and stderr go to `out` with the suffix
    .log. Concurrent engines must not size their KV cache by profiling free memory (another engine's allocations
    would count as theirs): set kv_cache_memory_bytes in the workers."""
    procs = []
    for out, command, env in jobs:
        if not out.exists():
            with open(out.with_suffix(".log"), "w") as log:
                procs.append((out, subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)))
    deadline = time.monotonic() + timeout_s
    failures = {}
    for out, proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            log = out.with_suffix(".log").read_text(errors="replace")
            failures[out] = f"{out.name} worker failed (rc {proc.returncode}):\n{log[-6000:]}"
    return [failures[out] if out in failures else json.loads(out.read_text()) for out, _, _ in jobs]


def run_workers(jobs: list[tuple[Path, list[str], dict[str, str]]], cwd: Path, timeout_s: float) -> list[dict]:
    """try_workers, asserting that every worker succeeded."""
    results = try_workers(jobs, cwd, timeout_s)
    failures = [r for r in results if isinstance(r, str)]
    assert not failures, "\n\n".join(failures)
    return results


# Engines prelaunch starts together at most (each takes ~6 GB of a GPU and a few CPU cores while it starts).
PRELAUNCH_AT_ONCE = 8


def prelaunch(request, plan, cwd: Path, timeout_s: float, at_once: int = PRELAUNCH_AT_ONCE) -> dict[Path, str]:
    """Runs the engines of every selected, not skipped test of the calling module together (at_once at a time),
    before the first of them starts (call it from a module-scoped autouse fixture): plan(item) gives a test
    item's jobs as run_workers takes them ([] for none). Each test then finds its engines' results written
    (run_workers skips a job whose `out` exists), so a file's tests share engine start-ups instead of paying
    one each. An engine that failed here runs again in its own test, which reports the failure, unless the test
    takes the report returned here (out -> try_workers' report of each failed engine)."""
    jobs, seen = [], set()
    for item in request.session.items:
        if item.module is not request.module or item.get_closest_marker("skip"):
            continue
        for job in plan(item):
            if job[0] not in seen:
                seen.add(job[0])
                jobs.append(job)
    failures: dict[Path, str] = {}
    if len(jobs) < 2:
        return failures
    for first in range(0, len(jobs), at_once):
        chunk = jobs[first: first + at_once]
        for (out, _, _), result in zip(chunk, try_workers(chunk, cwd=cwd, timeout_s=timeout_s)):
            if isinstance(result, str):  # the test that owns the engine reports it
                print(f"prelaunch: {result[:3000]}")
                failures[out] = result
    return failures


def prompt_logprobs(llm, prompts) -> tuple[list[list[float]], list[list[int]]]:
    """Teacher-forced: per prompt, the logprob of each prompt token and the top-1 token at each position."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    token_logprobs, top1 = [], []
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ids = prompt["prompt_token_ids"]
        lp, best = [], []
        for pos, entry in enumerate(output.prompt_logprobs):
            if entry is None:
                continue
            lp.append(entry[ids[pos]].logprob)
            best.append(min(entry.items(), key=lambda kv: kv[1].rank)[0])
        token_logprobs.append(lp)
        top1.append(best)
    return token_logprobs, top1


def greedy_tokens(llm, prompts, max_tokens: int) -> list[list[int]]:
    """Free-running: max_tokens greedy tokens per prompt (EOS ignored)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def teacher_forced(a: dict, b: dict) -> tuple[float, float]:
    """(top-1 agreement, max |logprob difference|) over every position of every prompt."""
    agree = total = 0
    worst = 0.0
    for lp_a, lp_b, t_a, t_b in zip(a["token_logprobs"], b["token_logprobs"], a["top1"], b["top1"]):
        assert len(lp_a) == len(lp_b)
        agree += sum(x == y for x, y in zip(t_a, t_b))
        total += len(t_a)
        worst = max([worst] + [abs(x - y) for x, y in zip(lp_a, lp_b)])
    return agree / total, worst


def greedy_prefix(a: dict, b: dict, key_a: str = "greedy", key_b: str = "greedy") -> float:
    """Mean length of the identical greedy prefix."""
    lengths = []
    for x, y in zip(a[key_a], b[key_b]):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        lengths.append(n)
    return sum(lengths) / len(lengths)


def assert_agrees_like_yardstick(candidate: tuple[dict, dict], yardstick: tuple[dict, dict], *, greedy_tokens: int,
                                 top1_margin: float, max_diff_factor: float, max_diff_slack: float,
                                 prefix_factor: float, extra: str = "") -> str:
    """The candidate pair agrees at least as well as the yardstick pair (two correct implementations) does,
    within the caller's noise margins; returns (and prints) the report."""
    import math

    (a, b), (x, y) = candidate, yardstick
    top1_c, diff_c = teacher_forced(a, b)
    top1_y, diff_y = teacher_forced(x, y)
    prefix_c, prefix_y = greedy_prefix(a, b), greedy_prefix(x, y)
    report = (
        f"{a['name']} vs {b['name']}: top-1 {top1_c:.4f}, max |dlogprob| {diff_c:.4f}, greedy prefix "
        f"{prefix_c:.1f}/{greedy_tokens} | yardstick {x['name']} vs {y['name']}: top-1 {top1_y:.4f}, "
        f"max |dlogprob| {diff_y:.4f}, greedy prefix {prefix_y:.1f}/{greedy_tokens}{extra}"
    )
    print(report)
    assert all(math.isfinite(v) for lp in a["token_logprobs"] for v in lp), f"{a['name']}: non-finite logprobs"
    assert top1_c >= top1_y - top1_margin, report
    assert diff_c <= max_diff_factor * diff_y + max_diff_slack, report
    assert prefix_c >= prefix_factor * prefix_y, report
    return report


def embeddings(llm, prompts) -> list[list[float]]:
    """A pooling engine's embedding of each prompt."""
    return [list(o.outputs.embedding) for o in llm.embed(prompts, use_tqdm=False)]


def cosine_distances(a: dict, b: dict) -> list[float]:
    """1 - cosine similarity of the two runs' embeddings of each prompt."""
    import math

    distances = []
    for x, y in zip(a["embeddings"], b["embeddings"]):
        dot = sum(p * q for p, q in zip(x, y))
        norm = math.sqrt(sum(p * p for p in x) * sum(q * q for q in y))
        distances.append(1.0 - dot / norm)
    return distances


def assert_embeds_like_yardstick(candidate: tuple[dict, dict], yardstick: tuple[dict, dict], *, mean_factor: float,
                                 max_factor: float, slack: float) -> str:
    """The candidate pair's embeddings are as close (cosine) as the yardstick pair's (two correct
    implementations), within the caller's noise margins; returns (and prints) the report."""
    import math

    (a, b), (x, y) = candidate, yardstick
    dist_c, dist_y = cosine_distances(a, b), cosine_distances(x, y)
    mean_c, mean_y = sum(dist_c) / len(dist_c), sum(dist_y) / len(dist_y)
    report = (f"{a['name']} vs {b['name']}: 1 - cos mean {mean_c:.2e}, max {max(dist_c):.2e} | yardstick "
              f"{x['name']} vs {y['name']}: mean {mean_y:.2e}, max {max(dist_y):.2e} ({len(dist_c)} prompts)")
    print(report)
    assert all(math.isfinite(d) for d in dist_c), f"{a['name']}: non-finite embeddings"
    assert mean_c <= mean_factor * mean_y + slack, report
    assert max(dist_c) <= max_factor * max(dist_y) + slack, report
    return report
