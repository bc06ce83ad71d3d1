"""scripts/soak.py without a GPU: its load plan, its pass/fail verdict, its HTTP client against a stand-in server
that streams like vLLM's /v1/completions, and its refusal where no GPU is visible (the real soak runs on the GPU
host: see the script's docstring)."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTEXT, VOCAB = 2048, 13618  # the tiny model's tokenizer has 13618 tokens
FAIL_500, FAIL_MID_STREAM = 3, 4  # first prompt token ids the stand-in server answers with a failure


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", REPO / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 1])
def test_plan_is_seeded_and_within_bounds(soak, seed):
    plan = soak.plan_load(seed, 2000, CONTEXT, VOCAB)
    assert plan == soak.plan_load(seed, 2000, CONTEXT, VOCAB) and plan != soak.plan_load(seed + 1, 2000, CONTEXT, VOCAB)
    assert [r.index for r in plan] == list(range(2000))
    assert all(soak.FIRST_TOKEN_ID <= t < VOCAB for r in plan for t in r.prompt)
    valid = [r for r in plan if not r.overlong]
    assert all(1 <= len(r.prompt) and 1 <= r.max_tokens <= 512 and len(r.prompt) + r.max_tokens <= CONTEXT
               for r in valid)
    assert max(len(r.prompt) for r in valid) > 0.95 * CONTEXT and max(r.max_tokens for r in valid) > 500
    overlong = [r for r in plan if r.overlong]
    assert 0.01 < len(overlong) / len(plan) < 0.03 and all(len(r.prompt) > CONTEXT for r in overlong)
    streams = [r for r in valid if r.stream]
    assert 0.45 < len(streams) / len(valid) < 0.55
    assert 0.06 < sum(r.disconnect_after is not None for r in streams) / len(streams) < 0.14
    assert all(r.disconnect_after is None for r in valid if not r.stream)
    assert 0.1 < sum(r.n > 1 for r in valid) / len(valid) < 0.2 and max(r.n for r in valid) == 4
    by_prefix = {}
    for r in valid:
        if r.prefix is not None:
            by_prefix.setdefault(r.prefix, []).append(r.prompt)
    assert sorted(by_prefix) == list(range(len(soak.PREFIX_LENGTHS)))
    for prefix, prompts in by_prefix.items():  # each prompt of a prefix starts with the same tokens, then goes on
        length = min(soak.PREFIX_LENGTHS[prefix], CONTEXT // 2)
        assert len(prompts) > 50 and all(p[:length] == prompts[0][:length] and len(p) > length for p in prompts)
    labels = [r.burst for r in plan]  # steady, burst 0, steady, burst 1, steady
    runs = [(label, len(list(group))) for label, group in itertools.groupby(labels)]
    assert [label for label, _ in runs] == [None, 0, None, 1, None]
    assert [size for label, size in runs if label is not None] == [256, 256]


def test_small_plans_keep_their_bursts_small(soak):
    plan = soak.plan_load(0, 20, 256, 400, burst_size=256, bursts=2)
    assert len(plan) == 20 and [sum(r.burst == k for r in plan) for k in (0, 1)] == [5, 5]
    assert all(len(r.prompt) + r.max_tokens <= 256 for r in plan if not r.overlong)


def clean_record(soak):
    """Outcomes, memory samples, probes and drain of a soak that passes."""
    outcomes = [soak.Outcome(0, "ok", 200), soak.Outcome(1, "disconnected", 200, planned_disconnect=True),
                soak.Outcome(2, "4xx", 400, overlong=True), soak.Outcome(3, "not_sent")]
    samples = [{"phase": phase, "memory_mib": mib, "alive": True, "healthy": True}
               for phase, mib in [("warmup", 900.0), ("baseline", 1000.0), ("soak", 1009.0), ("after", 1005.0)]]
    probes = [{"token_ids": [1, 2, 3], "text": "a b c"}, {"token_ids": [4], "text": "d"}]
    return outcomes, samples, probes, [dict(p) for p in probes], True


def test_a_clean_record_passes(soak):
    checks = soak.evaluate(*clean_record(soak))
    assert all(checks.values()), checks


@pytest.mark.parametrize("breakage, failed", [
    ("5xx", {"no_5xx", "valid_requests_completed"}),
    ("timeout", {"valid_requests_completed"}),
    ("unplanned_disconnect", {"valid_requests_completed"}),
    ("overlong_accepted", {"overlong_prompts_refused"}),
    ("overlong_500", {"no_5xx", "overlong_prompts_refused"}),
    ("memory_grew", {"memory_flat"}),
    ("memory_unread", {"memory_flat"}),
    ("server_died", {"server_stayed_up"}),
    ("health_failed", {"server_stayed_up"}),
    ("not_drained", {"server_drained"}),
    ("probe_changed", {"probes_identical"}),
])
def test_each_breakage_fails_its_check(soak, breakage, failed):
    outcomes, samples, before, after, drained = clean_record(soak)
    if breakage == "5xx":
        outcomes[0] = replace(outcomes[0], kind="5xx", status=500)
    elif breakage == "timeout":
        outcomes[0] = replace(outcomes[0], kind="error", status=None, detail="TimeoutError")
    elif breakage == "unplanned_disconnect":
        outcomes[1] = replace(outcomes[1], planned_disconnect=False)
    elif breakage == "overlong_accepted":
        outcomes[2] = replace(outcomes[2], kind="ok", status=200)
    elif breakage == "overlong_500":
        outcomes[2] = replace(outcomes[2], kind="5xx", status=500)
    elif breakage == "memory_grew":
        samples[2]["memory_mib"] = 1011.0  # 1.1 % over the baseline; 1009 passes above
    elif breakage == "memory_unread":
        samples[3]["memory_mib"] = None
    elif breakage == "server_died":
        samples[3]["alive"] = False
    elif breakage == "health_failed":
        samples[2]["healthy"] = False
    elif breakage == "not_drained":
        drained = False
    elif breakage == "probe_changed":
        after[1] = {"token_ids": [5], "text": "e"}
    checks = soak.evaluate(outcomes, samples, before, after, drained)
    assert {name for name, held in checks.items() if not held} == failed
    report = soak.summary(outcomes, samples, before, after, checks)
    assert report["counts"]["not_sent"] == 1 and report["memory_mib"]["baseline"] == 1000.0
    assert bool(report["failures"]) == bool(failed & {"no_5xx", "valid_requests_completed",
                                                      "overlong_prompts_refused"})


class StandIn(BaseHTTPRequestHandler):
    """vLLM's /v1/completions as the soak sees it: token-id prompts, n choices, SSE streams sent chunked (one
    event per token and choice, a usage event, [DONE]), 400 for prompts over CONTEXT, /health and /metrics."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, b"")
        elif self.path == "/metrics":
            self.reply(200, b'# HELP\nvllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{} 0.0\n',
                       "text/plain")
        else:
            self.reply(404, b"{}")

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n, count = request["prompt"], request.get("n", 1), request["max_tokens"]
        if len(prompt) > CONTEXT:
            return self.reply(400, json.dumps({"error": {"message": "maximum context length", "code": 400}}).encode())
        if prompt[0] == FAIL_500:
            return self.reply(500, b'{"error": {"message": "EngineDeadError"}}')
        tokens = [(sum(prompt) + i) % 1000 for i in range(count)]  # deterministic "greedy" tokens
        if not request.get("stream"):
            choices = [{"index": c, "text": " ".join(map(str, tokens)), "finish_reason": "length",
                        "token_ids": tokens if request.get("return_token_ids") else None} for c in range(n)]
            return self.reply(200, json.dumps({"choices": choices, "usage": {"completion_tokens": n * count}}).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"index": c, "text": f" {t}", "finish_reason": "length" if i == count - 1 else None}]}
                  for i, t in enumerate(tokens) for c in range(n)]
        if prompt[0] == FAIL_MID_STREAM:
            events[1:] = [{"error": {"message": "the engine died", "code": 500}}]
        events.append({"choices": [], "usage": {"completion_tokens": n * count}})
        try:
            for event in [json.dumps(e) for e in events] + ["[DONE]"]:
                data = f"data: {event}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except ConnectionError:  # the client hung up (a planned disconnect)
            self.close_connection = True


@pytest.fixture(scope="module")
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_client_classifies_real_responses(soak, stand_in):
    def sent(**fields):
        return soak.send(stand_in, soak.Planned(**{"index": 0, "prompt": (7, 8, 9), "max_tokens": 16,
                                                   "stream": False, **fields}))
    ok = sent(n=3)
    assert (ok.kind, ok.status, ok.tokens) == ("ok", 200, 48)
    streamed = sent(stream=True, n=2)
    assert (streamed.kind, streamed.tokens) == ("ok", 32) and streamed.first_chunk_s <= streamed.seconds
    hung_up = sent(stream=True, disconnect_after=3)
    assert (hung_up.kind, hung_up.planned_disconnect) == ("disconnected", True)
    assert sent(stream=True, max_tokens=1, disconnect_after=4).kind == "ok"  # the stream ended first
    refused = sent(prompt=(7,) * (CONTEXT + 1), overlong=True)
    assert (refused.kind, refused.status, refused.overlong) == ("4xx", 400, True) and "context" in refused.detail
    crashed = sent(prompt=(FAIL_500, 1))
    assert (crashed.kind, crashed.status) == ("5xx", 500)
    died = sent(prompt=(FAIL_MID_STREAM, 1), stream=True)
    assert died.kind == "error" and "engine died" in died.detail
    gone = soak.send(f"http://127.0.0.1:{soak.free_port()}", soak.Planned(0, (7,), 1, False))
    assert gone.kind == "error" and gone.status is None


def test_a_soak_against_the_stand_in_passes_and_a_failing_server_fails_it(soak, stand_in):
    plan = soak.plan_load(3, 60, CONTEXT, VOCAB, burst_size=16)
    plan.append(soak.Planned(len(plan), (7,) * (CONTEXT + 5), 8, stream=False, overlong=True))
    outcomes = soak.run_load(stand_in, plan, concurrency=8, deadline=time.monotonic() + 120)
    assert [o.index for o in outcomes] == list(range(len(plan)))
    for request, outcome in zip(plan, outcomes):
        expected = {"4xx"} if request.overlong else {"ok", "disconnected"} if request.disconnect_after else {"ok"}
        assert outcome.kind in expected, (request, outcome)
    assert sum(o.kind == "disconnected" for o in outcomes) > 0
    prompts = soak.probe_prompts(CONTEXT, VOCAB)
    before, after = soak.probe(stand_in, prompts, "before"), soak.probe(stand_in, prompts, "after")
    assert len(before) == 8 and all(len(p["token_ids"]) == soak.PROBE_TOKENS for p in before)

    class Alive:
        def poll(self):
            return None
    monitor = soak.Monitor(stand_in, Alive(), read_memory=lambda: 1000.0)
    for phase in ("warmup", "baseline", "soak", "after"):
        monitor.phase = phase
        assert monitor.sample()["healthy"]
    assert soak.wait_drained(stand_in, timeout=5)
    checks = soak.evaluate(outcomes, monitor.samples, before, after, True)
    assert all(checks.values()), checks

    broken = plan[:3] + [replace(plan[3], prompt=(FAIL_500,) + plan[3].prompt[1:])]
    failed = soak.run_load(stand_in, broken, concurrency=2, deadline=time.monotonic() + 120)
    assert not soak.evaluate(failed, monitor.samples, before, after, True)["no_5xx"]
    late = soak.run_load(stand_in, plan[:5], concurrency=2, deadline=time.monotonic() - 1)
    assert {o.kind for o in late} == {"not_sent"}


def test_exits_2_without_a_gpu(tmp_path):
    report = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--requests", "3", "--json", str(report)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot run the TK soak test" in proc.stderr and "no CUDA GPU is visible" in proc.stderr
    assert not report.exists()
