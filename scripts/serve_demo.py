"""Serve a locally built test model with vLLM's OpenAI-compatible server on the TK attention backend.

    python scripts/serve_demo.py [--preset tiny-hd128] [--model-dir DIR] [--json results.json]

On an sm_90 (Hopper) GPU with tk_backend's extension built and vLLM >= 0.26 importable (on the offline GPU host:
`source /tmp/vllm_site/env.sh` first), this
  1. builds the random-weight Llama-shaped model of examples/build_tiny_model.py (tokenizer trained locally),
  2. starts `vllm serve MODEL --attention-backend TK` on 127.0.0.1 (CUDA graphs and prefix caching on),
  3. sends one /v1/completions and one /v1/chat/completions request and prints the answers and their speed,
  4. measures throughput with a burst of concurrent completions,
  5. stops the server it started (its whole process group), whatever happened.
Anywhere else it says what is missing and exits with status 2. Server failures exit 1 with the log's tail.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVED_NAME = "tk-tiny"


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment for a vLLM process here: offline (no hub, no usage stats) and vLLM's own sampler unless
    VLLM_USE_FLASHINFER_SAMPLER says otherwise; `extra` on top."""
    return {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **extra}


def refuse(headline: str, problems: list[str]) -> int:
    """Print why this machine cannot run a script (headline, then a line a problem); returns exit status 2."""
    print(headline, file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return 2


def missing_requirements(gpus: int = 1) -> list[str]:
    """Why this machine cannot run the demo on `gpus` GPUs (empty: it can)."""
    problems = []
    try:
        import torch
    except ImportError:
        return ["PyTorch is not installed"]
    if not torch.cuda.is_available():
        problems.append("no CUDA GPU is visible: the TK kernels need an NVIDIA Hopper (sm_90) GPU such as H100/H200")
    else:
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            problems.append(f"GPU 0 is {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}); the TK kernels are "
                            "written for sm_90 (Hopper: H100/H200) only")
        if torch.cuda.device_count() < gpus:
            problems.append(f"--tensor-parallel-size {gpus} needs {gpus} GPUs; {torch.cuda.device_count()} visible")
    sys.path.insert(0, str(REPO))
    try:
        import tk_backend

        if not tk_backend.extension_available():
            problems.append("tk_backend._C is not built: pip install --no-build-isolation -e .")
    except ImportError as exc:
        problems.append(f"tk_backend does not import ({exc})")
    try:
        import vllm  # noqa: F401
    except ImportError:
        problems.append("vLLM is not importable (GPU host: `source /tmp/vllm_site/env.sh`; elsewhere pip install vllm)")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, payload: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_ready(base: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"the server was not ready after {timeout:.0f} s")


def serve_command(model_dir: str | Path, port: int, backend: str = "TK", max_model_len: int = 4096,
                  tensor_parallel_size: int = 1) -> list[str]:
    """`vllm serve` of model_dir as SERVED_NAME on 127.0.0.1:port with the `backend` attention backend: CUDA graphs
    (vLLM's default) and prefix caching on, half the GPU memory."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
            "--attention-backend", backend, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", "0.5", "--enable-prefix-caching",
            "--tensor-parallel-size", str(tensor_parallel_size)]


def start_server(command: list[str], log_path: Path, cwd: str | Path) -> subprocess.Popen:
    """Run `command` in vllm_env(), its output to log_path, in a process group of its own (which stop() ends)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), cwd=cwd,
                                start_new_session=True)


def log_tail(log_path: Path, lines: int = 60) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def stop(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def timed(fn, *args) -> tuple[dict, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def run_requests(base: str, burst: int, burst_tokens: int) -> dict:
    results = {}
    completion, seconds = timed(post, f"{base}/v1/completions", {
        "model": SERVED_NAME, "prompt": "The kernel reads a tile of memory and", "max_tokens": 64,
        "temperature": 0.0,
    })
    tokens = completion["usage"]["completion_tokens"]
    results["completion"] = {"text": completion["choices"][0]["text"], "tokens": tokens, "seconds": seconds,
                             "tok_s": tokens / seconds}

    chat, seconds = timed(post, f"{base}/v1/chat/completions", {
        "model": SERVED_NAME, "max_tokens": 64, "temperature": 0.0,
        "messages": [{"role": "system", "content": "You are a careful engineer."},
                     {"role": "user", "content": "Explain what a paged KV cache is."}],
    })
    tokens = chat["usage"]["completion_tokens"]
    results["chat"] = {"text": chat["choices"][0]["message"]["content"], "tokens": tokens, "seconds": seconds,
                       "tok_s": tokens / seconds}

    # Throughput: concurrent requests that all generate burst_tokens tokens.
    payload = {"model": SERVED_NAME, "max_tokens": burst_tokens, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"Request {i}: describe the {i % 7}th stage of the pipeline." for i in range(burst)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=burst) as pool:
        answers = list(pool.map(lambda p: post(f"{base}/v1/completions", {**payload, "prompt": p}), prompts))
    seconds = time.perf_counter() - start
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    results["burst"] = {"requests": burst, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-hd128")
    parser.add_argument("--model-dir", help="where to build (or find) the model; default: a temporary folder")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--burst-tokens", type=int, default=128)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vLLM tensor parallelism: each of this many GPUs runs TK on its slice of the heads")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    problems = missing_requirements(args.tensor_parallel_size)
    if problems:
        return refuse("serve_demo: this machine cannot run the TK serving demo:", problems)

    sys.path.insert(0, str(REPO / "examples"))
    from build_tiny_model import build

    with tempfile.TemporaryDirectory(prefix="tk_serve_demo_") as tmp:
        model_dir = build(args.model_dir or Path(tmp) / "model", preset=args.preset)
        print(f"serve_demo: model {args.preset} at {model_dir}")
        port = args.port or free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "server.log"
        command = serve_command(model_dir, port, tensor_parallel_size=args.tensor_parallel_size)
        print("serve_demo: " + " ".join(command))
        server = start_server(command, log_path, cwd=tmp)
        try:
            started = time.perf_counter()
            wait_ready(base, server, args.startup_timeout)
            print(f"serve_demo: server ready after {time.perf_counter() - started:.0f} s")
            results = run_requests(base, args.burst, args.burst_tokens)
        except Exception as exc:  # report, then stop the server in `finally`
            print(f"serve_demo: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            print("---- server log (tail) ----", file=sys.stderr)
            print(log_tail(log_path), file=sys.stderr)
            return 1
        finally:
            stop(server)

    print(f"\n/v1/completions ({results['completion']['tokens']} tokens, "
          f"{results['completion']['tok_s']:.1f} tok/s):\n  {results['completion']['text']!r}")
    print(f"\n/v1/chat/completions ({results['chat']['tokens']} tokens, "
          f"{results['chat']['tok_s']:.1f} tok/s):\n  {results['chat']['text']!r}")
    burst = results["burst"]
    print(f"\nthroughput: {burst['requests']} concurrent requests, {burst['tokens']} tokens in "
          f"{burst['seconds']:.2f} s = {burst['tok_s']:.0f} output tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "tensor_parallel_size": args.tensor_parallel_size,
                                               **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
