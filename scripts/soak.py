"""Soak-test vLLM's OpenAI server on the TK attention backend: a long, mixed load drawn from a seed, then checks
that nothing broke or leaked.

    python scripts/soak.py [--requests 2000] [--max-seconds 1200] [--concurrency 64] [--seed 0]
                           [--attention-backend TK] [--max-model-len 2048] [--json bench/results/soak.json]

Where serve_demo.py runs (sm_90, tk_backend built, vLLM importable; GPU host: `source /tmp/vllm_site/env.sh`
first), this builds the tiny random-weight model of examples/build_tiny_model.py, starts `vllm serve` on
127.0.0.1 (serve_demo.serve_command: CUDA graphs and prefix caching on) and sends the load plan_load draws
from the seed: token-id prompts of random length up to --max-model-len, some starting with one of a few shared
prefixes (prefix-cache hits); max_tokens 1..512 within the context; streamed or not; n > 1 for some; ~10 % of
the streams closed after a few chunks; ~2 % prompts longer than the context; bursts of 256 concurrent requests.
It passes (evaluate) when no response was a 5xx, every valid request completed (or was closed on purpose),
every over-long prompt got a 4xx, the server stayed alive and healthy and drained, GPU memory stayed within
1 % of its value after the warm-up, and greedy probes gave the same tokens before and after the load.
The JSON report records each check. Exit status: 0 passed, 1 failed, 2 this machine cannot run it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import commit_of_tree  # noqa: E402
from serve_demo import (REPO, SERVED_NAME, free_port, log_tail, missing_requirements, post, refuse,  # noqa: E402
                        serve_command, start_server, stop, wait_ready)

MAX_TOKENS = 512
STREAM_FRACTION = 0.5
DISCONNECT_FRACTION = 0.1   # of the streams: the client closes the connection after 1-4 chunks
SAMPLED_FRACTION = 0.15     # n = 2..4 at temperature 0.8
PREFIX_FRACTION = 0.3       # the prompt starts with one of the shared prefixes
PREFIX_LENGTHS = (48, 256, 700, 1200)  # tokens, each at most half the context
OVERLONG_FRACTION = 0.02    # prompts longer than the context: vLLM must refuse them with a 4xx
WARMUP_FRACTION = 0.1       # the first requests, after which GPU memory is the baseline
MEMORY_TOLERANCE = 0.01
FIRST_TOKEN_ID = 5          # ids below are the tokenizer's special tokens
PROBE_LENGTHS = (5, 17, 64, 255, 512, 1000, 1500, 2000)
PROBE_TOKENS = 32
SAMPLE_SECONDS = 3
REQUEST_TIMEOUT_S = 600


@dataclass(frozen=True)
class Planned:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    n: int = 1
    temperature: float = 0.0
    disconnect_after: int | None = None  # streamed chunks read before the client hangs up
    overlong: bool = False               # longer than the context: must be refused
    prefix: int | None = None            # the shared prefix the prompt starts with
    burst: int | None = None             # the burst it is sent in (None: the steady stream)

    def payload(self) -> dict:
        body = {"model": SERVED_NAME, "prompt": list(self.prompt), "max_tokens": self.max_tokens, "n": self.n,
                "temperature": self.temperature, "seed": self.index, "stream": self.stream}
        return {**body, "stream_options": {"include_usage": True}} if self.stream else body


def plan_load(seed: int, requests: int, max_model_len: int, vocab_size: int, burst_size: int = 256,
              bursts: int = 2) -> list[Planned]:
    """`requests` requests drawn from `seed` alone, in sending order: the steady stream cut into bursts + 1 equal
    stretches with a burst between each two (of burst_size requests, fewer when `requests` is small)."""
    rng = random.Random(seed)

    def tokens(count: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count))

    prefixes = [tokens(min(length, max_model_len // 2)) for length in PREFIX_LENGTHS]
    burst_size = min(burst_size, requests // (2 * bursts)) if bursts else 0
    steady = requests - burst_size * bursts
    stretches = [steady * (k + 1) // (bursts + 1) - steady * k // (bursts + 1) for k in range(bursts + 1)]
    order = [None] * stretches[0]  # the burst of each request
    for k in range(bursts):
        order += [k] * burst_size + [None] * stretches[k + 1]

    def draw(index: int, burst: int | None) -> Planned:
        if rng.random() < OVERLONG_FRACTION:
            return Planned(index, tokens(rng.randint(max_model_len + 1, max_model_len + 512)),
                           rng.randint(1, MAX_TOKENS), stream=False, overlong=True, burst=burst)
        prefix = rng.randrange(len(prefixes)) if rng.random() < PREFIX_FRACTION else None
        head = prefixes[prefix] if prefix is not None else ()
        prompt = head + tokens(rng.randint(1, max_model_len - 1 - len(head)))
        max_tokens = min(rng.randint(1, MAX_TOKENS), max_model_len - len(prompt))
        stream = rng.random() < STREAM_FRACTION
        n, temperature = (rng.randint(2, 4), 0.8) if rng.random() < SAMPLED_FRACTION else (1, rng.choice((0.0, 0.8)))
        disconnect = rng.randint(1, 4) if stream and rng.random() < DISCONNECT_FRACTION else None
        return Planned(index, prompt, max_tokens, stream, n, temperature, disconnect, prefix=prefix, burst=burst)

    return [draw(i, burst) for i, burst in enumerate(order)]


def probe_prompts(max_model_len: int, vocab_size: int) -> list[tuple[int, ...]]:
    rng = random.Random(1234)
    return [tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(min(length, max_model_len - PROBE_TOKENS)))
            for length in PROBE_LENGTHS]


@dataclass
class Outcome:
    index: int
    kind: str = "error"  # ok | disconnected | 4xx | 5xx | error | not_sent
    status: int | None = None
    seconds: float = 0.0
    first_chunk_s: float | None = None
    tokens: int = 0
    detail: str = ""
    overlong: bool = False
    planned_disconnect: bool = False


def send(base: str, request: Planned, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """POST one planned request to /v1/completions and classify what came back."""
    out = Outcome(request.index, overlong=request.overlong, planned_disconnect=request.disconnect_after is not None)
    url = urllib.parse.urlsplit(base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    start = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", json.dumps(request.payload()),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        out.status = response.status
        if response.status != 200:
            out.kind = "5xx" if response.status >= 500 else "4xx" if response.status >= 400 else "error"
            out.detail = response.read(300).decode(errors="replace")
        elif request.stream:
            read_stream(response, request, out, start)
        else:
            body = json.loads(response.read())
            finished = {c["index"] for c in body.get("choices", []) if c.get("finish_reason")}
            out.tokens = body.get("usage", {}).get("completion_tokens", 0)
            check_finished(finished, request, out)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        out.kind, out.detail = "error", f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()  # also how a planned disconnect hangs up
        out.seconds = time.perf_counter() - start
    return out


def read_stream(response: http.client.HTTPResponse, request: Planned, out: Outcome, start: float) -> None:
    """Read server-sent events up to `data: [DONE]` (or, for a planned disconnect, disconnect_after chunks)."""
    finished, chunks = set(), 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):].strip()
        if data == b"[DONE]":
            return check_finished(finished, request, out)
        event = json.loads(data)
        if "error" in event:  # vLLM reports a failure after the 200 as an event
            out.kind, out.detail = "error", json.dumps(event["error"])[:300]
            return
        chunks += 1
        out.first_chunk_s = out.first_chunk_s or time.perf_counter() - start
        finished |= {c["index"] for c in event.get("choices", []) if c.get("finish_reason")}
        out.tokens = (event.get("usage") or {}).get("completion_tokens", out.tokens)
        if request.disconnect_after and chunks >= request.disconnect_after:
            out.kind = "disconnected"
            return
    out.kind, out.detail = "error", f"the stream ended without [DONE] after {chunks} chunks"


def check_finished(finished: set[int], request: Planned, out: Outcome) -> None:
    if finished == set(range(request.n)):
        out.kind = "ok"
    else:
        out.kind, out.detail = "error", f"choices {sorted(finished)} finished, expected {request.n}"


def run_load(base: str, plan: list[Planned], concurrency: int, deadline: float) -> list[Outcome]:
    """Send `plan` in order: its steady stretches `concurrency` at a time, each burst all at once; nothing new
    starts after `deadline` (time.monotonic()); what is left comes back as not_sent."""
    def one(request: Planned) -> Outcome:
        if time.monotonic() < deadline:
            return send(base, request)
        return Outcome(request.index, "not_sent", overlong=request.overlong)

    outcomes = []
    for burst, group in itertools.groupby(plan, key=lambda r: r.burst):
        group = list(group)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency if burst is None else len(group)) as pool:
            outcomes += pool.map(one, group)
        label = "steady" if burst is None else f"burst {burst}"
        print(f"soak: {label}: {len(group)} requests in {time.monotonic() - started:.0f} s", flush=True)
    return outcomes


def probe(base: str, prompts: list[tuple[int, ...]], salt: str) -> list[dict]:
    """Greedy completions of `prompts`, one at a time (each alone in its batch), under a cache salt of this pass
    (so no pass reuses another's KV blocks): [{"token_ids", "text"}, ...]."""
    answers = []
    for prompt in prompts:
        choice = post(f"{base}/v1/completions", {
            "model": SERVED_NAME, "prompt": list(prompt), "max_tokens": PROBE_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "cache_salt": salt})["choices"][0]
        answers.append({"token_ids": choice.get("token_ids"), "text": choice["text"]})
    return answers


def nvidia_smi(query: str) -> list[str]:
    """One line per GPU in CUDA_VISIBLE_DEVICES (all GPUs when unset) of `nvidia-smi --query-gpu=query`."""
    command = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        command.append(f"--id={os.environ['CUDA_VISIBLE_DEVICES']}")
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()


def gpu_memory_mib() -> float | None:
    """GPU memory in use (MiB, summed over the visible GPUs); from nvidia-smi, so this process holds no CUDA memory."""
    try:
        return sum(float(line) for line in nvidia_smi("memory.used"))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=30) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_drained(base: str, timeout: float = 120) -> bool:
    """Whether vLLM's /metrics shows no request running or waiting within `timeout` seconds (so the streams the
    clients closed were aborted, not leaked). Its gauges move only when the engine steps, so a one-token
    request goes first each time."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            post(f"{base}/v1/completions", {"model": SERVED_NAME, "prompt": [FIRST_TOKEN_ID], "max_tokens": 1})
            time.sleep(1)
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
                gauges = [float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                          if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))]
            if gauges and not any(gauges):
                return True
        except (OSError, ValueError, IndexError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1)


class Monitor(threading.Thread):
    """Every SAMPLE_SECONDS, and whenever sample() is called: GPU memory, whether the server process is alive,
    whether /health answers; each sample tagged with the phase the soak is in."""

    def __init__(self, base: str, server: subprocess.Popen, read_memory=gpu_memory_mib):
        super().__init__(daemon=True)
        self.base, self.server, self.read_memory = base, server, read_memory
        self.phase, self.samples, self.done, self.start_s = "warmup", [], threading.Event(), time.monotonic()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_SECONDS):
            self.sample()

    def sample(self) -> dict:
        record = {"t": round(time.monotonic() - self.start_s, 1), "phase": self.phase,
                  "memory_mib": self.read_memory(), "alive": self.server.poll() is None, "healthy": healthy(self.base)}
        self.samples.append(record)
        return record

    def stop(self) -> None:
        self.done.set()
        self.join()


def unexpected(o: Outcome) -> bool:
    """Whether `o` fails the soak: an over-long prompt not refused with a 4xx, a valid request neither completed
    nor closed on purpose (a request never sent fails nothing)."""
    if o.kind == "not_sent":
        return False
    if o.overlong:
        return o.kind != "4xx"
    return not (o.kind == "ok" or (o.kind == "disconnected" and o.planned_disconnect))


def memory_after_warmup(samples: list[dict]) -> tuple[float | None, list[float | None]]:
    """The memory sample of phase "baseline" (taken once the warm-up drained) and those after it."""
    baseline = next((s["memory_mib"] for s in samples if s["phase"] == "baseline"), None)
    return baseline, [s["memory_mib"] for s in samples if s["phase"] not in ("warmup", "baseline")]


def evaluate(outcomes: list[Outcome], samples: list[dict], probes_before: list, probes_after: list,
             drained: bool) -> dict[str, bool]:
    """The pass criteria by name; memory after the warm-up must stay within MEMORY_TOLERANCE of its baseline."""
    baseline, later = memory_after_warmup(samples)
    return {
        "no_5xx": not any(o.kind == "5xx" for o in outcomes),
        "valid_requests_completed": not any(unexpected(o) for o in outcomes if not o.overlong),
        "overlong_prompts_refused": not any(unexpected(o) for o in outcomes if o.overlong),
        "server_stayed_up": bool(samples) and all(s["alive"] and s["healthy"] for s in samples),
        "server_drained": drained,
        "memory_flat": baseline is not None and bool(later) and None not in later
                       and max(later) <= baseline * (1 + MEMORY_TOLERANCE),
        "probes_identical": bool(probes_before) and probes_before == probes_after,
    }


def percentiles(values: list[float]) -> dict | None:
    values = sorted(values)
    if not values:
        return None
    return {**{f"p{q}": round(values[len(values) * q // 100], 3) for q in (50, 90, 99)},
            "max": round(values[-1], 3), "count": len(values)}


def summary(outcomes: list[Outcome], samples: list[dict], probes_before: list, probes_after: list,
            checks: dict[str, bool]) -> dict:
    """The report's measurements: counts by outcome, latencies, memory, probes, the first failures."""
    ok = [o for o in outcomes if o.kind == "ok"]
    memory = [s["memory_mib"] for s in samples if s["memory_mib"] is not None]
    baseline, later = memory_after_warmup(samples)
    later = [m for m in later if m is not None]
    return {
        "counts": {kind: sum(o.kind == kind for o in outcomes)
                   for kind in ("ok", "disconnected", "4xx", "5xx", "error", "not_sent")},
        "overlong": {"sent": sum(o.overlong and o.kind != "not_sent" for o in outcomes),
                     "status_400": sum(o.overlong and o.status == 400 for o in outcomes)},
        "output_tokens": sum(o.tokens for o in ok),
        "latency_s": percentiles([o.seconds for o in ok]),
        "first_chunk_s": percentiles([o.first_chunk_s for o in ok if o.first_chunk_s is not None]),
        "memory_mib": {"samples": len(samples), "min": min(memory, default=None), "baseline": baseline,
                       "max_after": max(later, default=None), "last": later[-1] if later else None,
                       "growth": round(max(later) / baseline - 1, 5) if baseline and later else None},
        "health_failures": sum(not (s["alive"] and s["healthy"]) for s in samples),
        "probes": {"count": len(probes_before), "identical": checks["probes_identical"],
                   "differing": [i for i, (a, b) in enumerate(zip(probes_before, probes_after)) if a != b]},
        "failures": [asdict(o) for o in outcomes if unexpected(o)][:20],
    }


def tokenizer_vocab_size(model_dir: Path) -> int:
    return len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"])


def device_name() -> str:
    try:
        return nvidia_smi("name")[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def soak(args: argparse.Namespace, model_dir: Path, tmp: str) -> dict:
    """Start the server, run probes / warm-up / load / probes against it, stop it; the report's body."""
    vocab = tokenizer_vocab_size(model_dir)
    plan = plan_load(args.seed, args.requests, args.max_model_len, vocab, args.burst_size, args.bursts)
    warmup = max(1, int(len(plan) * WARMUP_FRACTION))
    prompts = probe_prompts(args.max_model_len, vocab)
    port = args.port or free_port()
    base, log_path = f"http://127.0.0.1:{port}", Path(tmp) / "server.log"
    command = serve_command(model_dir, port, args.attention_backend, args.max_model_len)
    print("soak: " + " ".join(command), flush=True)
    server = start_server(command, log_path, cwd=tmp)
    monitor = Monitor(base, server)
    try:
        wait_ready(base, server, args.startup_timeout)
        monitor.start()
        deadline = time.monotonic() + args.max_seconds
        before = probe(base, prompts, "probe-before")
        outcomes = run_load(base, plan[:warmup], args.concurrency, deadline)
        wait_drained(base)
        monitor.phase = "baseline"
        monitor.sample()
        monitor.phase = "soak"
        outcomes += run_load(base, plan[warmup:], args.concurrency, deadline)
        drained = wait_drained(base)
        after = probe(base, prompts, "probe-after")
        monitor.phase = "after"
        monitor.sample()
    except Exception as exc:  # report with the log's tail, then stop the server in `finally`
        print(f"soak: FAILED: {type(exc).__name__}: {exc}\n---- server log (tail) ----\n{log_tail(log_path)}",
              file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {exc}", "checks": {}, "passed": False}
    finally:
        if monitor.is_alive():
            monitor.stop()
        stop(server)
    checks = evaluate(outcomes, monitor.samples, before, after, drained)
    return {"requests_planned": len(plan), "warmup_requests": warmup, "server_pid": server.pid,
            **summary(outcomes, monitor.samples, before, after, checks), "memory_samples": monitor.samples,
            "checks": checks, "passed": all(checks.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-seconds", type=float, default=1200, help="no new request after this long")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight outside the bursts")
    parser.add_argument("--burst-size", type=int, default=256)
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-backend", default="TK")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--preset", default="tiny-hd128")
    parser.add_argument("--model-dir", help="where to build (or find) the model; default: a temporary folder")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "soak.json"))
    args = parser.parse_args()

    problems = missing_requirements()
    if not shutil.which("nvidia-smi"):
        problems.append("nvidia-smi is not on PATH (it samples the GPU memory)")
    if problems:
        return refuse("soak: this machine cannot run the TK soak test:", problems)

    sys.path.insert(0, str(REPO / "examples"))
    from build_tiny_model import build

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tk_soak_") as tmp:
        model_dir = build(args.model_dir or Path(tmp) / "model", preset=args.preset)
        body = soak(args, Path(model_dir), tmp)
    report = {"commit": commit_of_tree(), "device": device_name(), "backend": args.attention_backend,
              "preset": args.preset, "seed": args.seed, "max_model_len": args.max_model_len,
              "concurrency": args.concurrency, **body, "elapsed_s": round(time.monotonic() - started, 1)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for name, held in report["checks"].items():
        print(f"soak: {'ok  ' if held else 'FAIL'} {name}")
    print(f"soak: {'PASSED' if report['passed'] else 'FAILED'} in {report['elapsed_s']:.0f} s "
          f"({report.get('counts')}); report: {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
