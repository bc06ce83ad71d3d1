"""End to end on an H200: the Based model (tk_backend.models) in transformers and in vLLM (0.26.0 on the GPU host).

The random-weight Based model of examples/build_tiny_based.py (linear attention, sliding-window attention and
BaseConv layers) runs, each in its own process (python -m tests.gpu.test_vllm_based_e2e --worker ...):

* transformers, bfloat16, on tk_backend's kernels (parallel_based / based_step / flash_attn_func): "hf-tk";
* transformers, float32, on the pure-torch references (the same weights upcast): "hf-fp32", the accuracy anchor;
* vLLM with the TK attention backend, its recurrent state in vLLM's state cache, chunked prefill (prompts up to
  1500 tokens against a 512-token step budget, so long prompts continue from a cached state), CUDA graphs on
  ("vllm-graph") and off ("vllm-eager").

Measured on 32 random prompts: teacher-forced prompt logprobs (top-1 agreement, max |logprob difference| of the
prompt token) and the identical greedy prefix (32 new tokens). Random models have nearly tied logits, so two
correct implementations disagree somewhat; hf-tk vs hf-fp32 is the yardstick and vLLM must agree with hf-fp32
about as well (margins printed with every number). A last test serves the model on the OpenAI API.
Needs vLLM importable (GPU host: source /tmp/vllm_site/env.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import vllm_harness as harness
from tests.gpu.vllm_harness import greedy_prefix, greedy_tokens, prompt_logprobs, teacher_forced

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 32
GREEDY_TOKENS = 32
WORKER_TIMEOUT_S = 900
TOP1_MARGIN = 0.01
MAX_DIFF_FACTOR, MAX_DIFF_SLACK = 1.5, 0.05
PREFIX_FACTOR = 0.8


def _prompts(vocab: int, seed: int = 4321) -> list[list[int]]:
    rng = random.Random(seed)
    low = 16  # clear of the special tokens
    prompts = []
    for _ in range(NUM_PROMPTS):
        n = rng.choice([rng.randint(2, 63), rng.randint(64, 700), rng.randint(701, 1500)])
        prompts.append([rng.randrange(low, vocab) for _ in range(n)])
    return prompts


# ------------------------------------------------------------------------------------------------ workers


def run_hf_worker(model_dir: str, mode: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tk_backend.models
    from tk_backend.models.modeling_based import kernels_usable

    tk_backend.models.register()
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    dtype = torch.bfloat16 if mode == "tk" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    probe = torch.zeros(1, device="cuda", dtype=dtype)
    assert kernels_usable(probe) == (mode == "tk"), f"hf-{mode}: kernels_usable is {kernels_usable(probe)}"
    token_logprobs, top1, greedy = [], [], []
    with torch.no_grad():
        for prompt in _prompts(vocab):
            ids = torch.tensor([prompt], device="cuda")
            logprobs = model(ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
            token_logprobs.append(logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist())
            top1.append(logprobs.argmax(-1).tolist())
            greedy.append(model.greedy(ids, GREEDY_TOKENS)[0].tolist())
    Path(out).write_text(json.dumps({"name": f"hf-{mode}", "token_logprobs": token_logprobs, "top1": top1,
                                     "greedy": greedy}))


def run_vllm_worker(model_dir: str, mode: str, out: str) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(vocab)]
    llm = LLM(
        model=model_dir, attention_backend="TK", seed=0, max_model_len=2048, max_num_seqs=64,
        max_num_batched_tokens=512, enable_chunked_prefill=True, enable_prefix_caching=False,
        gpu_memory_utilization=0.1, kv_cache_memory_bytes=harness.E2E_KV_CACHE_BYTES, enforce_eager=(mode == "eager"),
    )
    token_logprobs, top1 = prompt_logprobs(llm, prompts)
    tokens = greedy_tokens(llm, prompts, GREEDY_TOKENS)
    Path(out).write_text(json.dumps({"name": f"vllm-{mode}", "token_logprobs": token_logprobs, "top1": top1,
                                     "greedy": tokens}))


def _run(model_dir: Path, out_dir: Path, *runs: tuple[str, str]) -> list[dict]:
    """The results of each (kind, mode) worker, the missing ones run at once (harness.run_workers)."""
    # plugins (and the model registration) load in spawned workers
    env = harness.vllm_env(VLLM_WORKER_MULTIPROC_METHOD="spawn")
    jobs = [(out_dir / f"{kind}_{mode}.json",
             [sys.executable, "-m", "tests.gpu.test_vllm_based_e2e", "--worker", kind, "--model", str(model_dir),
              "--mode", mode, "--out", str(out_dir / f"{kind}_{mode}.json")], env) for kind, mode in runs]
    return harness.run_workers(jobs, cwd=REPO, timeout_s=WORKER_TIMEOUT_S)


# ------------------------------------------------------------------------------------------------ metrics


def assert_agrees_like_yardstick(candidate: tuple[dict, dict], yardstick: tuple[dict, dict]) -> str:
    """The candidate pair agrees at least as well as the yardstick pair (two correct implementations) does."""
    return harness.assert_agrees_like_yardstick(
        candidate, yardstick, greedy_tokens=GREEDY_TOKENS, top1_margin=TOP1_MARGIN, max_diff_factor=MAX_DIFF_FACTOR,
        max_diff_slack=MAX_DIFF_SLACK, prefix_factor=PREFIX_FACTOR)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    sys.path.insert(0, str(REPO / "examples"))
    from build_tiny_based import build

    return build(harness.workdir(tmp_path_factory, "vllm_based") / "tiny-based", preset="tiny-based")


def test_vllm_based_agrees_with_transformers(model_dir):
    out_dir = model_dir.parent
    fp32, hf_tk, graph, eager = _run(model_dir, out_dir, ("hf", "fp32"), ("hf", "tk"), ("vllm", "graph"),
                                     ("vllm", "eager"))
    top1, diff = teacher_forced(graph, hf_tk)
    print(f"vllm-graph vs hf-tk: top-1 {top1:.4f}, max |dlogprob| {diff:.4f}, greedy prefix "
          f"{greedy_prefix(graph, hf_tk):.1f}/{GREEDY_TOKENS}; vllm-graph vs vllm-eager greedy prefix "
          f"{greedy_prefix(graph, eager):.1f}/{GREEDY_TOKENS}")
    assert_agrees_like_yardstick((graph, fp32), (hf_tk, fp32))
    assert_agrees_like_yardstick((eager, fp32), (hf_tk, fp32))


def test_openai_server_answers_with_based(model_dir):
    sys.path.insert(0, str(REPO / "scripts"))
    import serve_demo

    port = serve_demo.free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    command = ["vllm", "serve", str(model_dir), "--served-model-name", serve_demo.SERVED_NAME, "--host", "127.0.0.1",
               "--port", str(port), "--attention-backend", "TK", "--max-model-len", "2048",
               "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching"]
    log = model_dir.parent / "serve.log"
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            try:
                serve_demo.wait_ready(base, server, timeout=600)
            except (RuntimeError, TimeoutError) as exc:
                pytest.fail(f"{exc}\n{log.read_text()[-8000:]}")
            results = serve_demo.run_requests(base, burst=8, burst_tokens=32)
        finally:
            serve_demo.stop(server)
    print(json.dumps(results, indent=1))
    assert results["completion"]["tokens"] > 0 and results["chat"]["tokens"] > 0
    assert results["burst"]["tokens"] == 8 * 32


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=["hf", "vllm"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    (run_hf_worker if args.worker == "hf" else run_vllm_worker)(args.model, args.mode, args.out)
