"""scripts/serve_demo.py without a GPU: its refusal on a non-Hopper machine, and its client and server-stopping
logic against a stand-in OpenAI-compatible server (the real server runs in tests/gpu/test_vllm_e2e.py)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("serve_demo", REPO / "scripts" / "serve_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_without_a_hopper_gpu(demo, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["serve_demo.py"])
    assert demo.main() == 2
    err = capsys.readouterr().err
    assert "cannot run the TK serving demo" in err and "Hopper (sm_90)" in err


STAND_IN_SERVER = textwrap.dedent("""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({}) if self.path == "/health" else self.send_error(404)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert request["model"] == "tk-tiny"
            n = request["max_tokens"]
            usage = {"completion_tokens": n}
            if self.path == "/v1/completions":
                self._send({"choices": [{"text": " tokens" * n}], "usage": usage})
            elif self.path == "/v1/chat/completions":
                assert request["messages"][-1]["role"] == "user"
                self._send({"choices": [{"message": {"content": "an answer"}}], "usage": usage})
            else:
                self.send_error(404)

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def test_client_and_shutdown_against_a_stand_in_server(demo):
    port = demo.free_port()
    server = subprocess.Popen([sys.executable, "-c", STAND_IN_SERVER, str(port)], start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        demo.wait_ready(base, server, timeout=60)
        results = demo.run_requests(base, burst=4, burst_tokens=8)
    finally:
        demo.stop(server)
    assert server.poll() is not None  # stopped
    assert results["completion"]["tokens"] == 64 and results["completion"]["text"].startswith(" tokens")
    assert results["chat"]["text"] == "an answer"
    assert results["burst"]["requests"] == 4 and results["burst"]["tokens"] == 32 and results["burst"]["tok_s"] > 0


def test_wait_ready_reports_a_server_that_died(demo):
    server = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        demo.wait_ready(f"http://127.0.0.1:{demo.free_port()}", server, timeout=60)
