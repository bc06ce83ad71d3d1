"""End to end on an H200 with vLLM (0.26.0 on the GPU host): the TK backend against FLASH_ATTN and TRITON_ATTN.

Each backend serves the same random-weight Llama-shaped model (examples/build_tiny_model.py) and the same 64
random prompts, in its own process (python -m tests.gpu.test_vllm_e2e --worker ...; a test's engines run at
once), with CUDA graphs, prefix caching and chunked prefill on (prompts up to 1500 tokens against a 512-token
step budget, 16 prompts sharing a 300-token prefix, the generation pass run twice so the second one hits the
prefix cache). Measured:

* teacher-forced: prompt logprobs at every position of every prompt; top-1 agreement and the largest
  |logprob difference| of the prompt token between two backends;
* free-running: the length of the identical greedy prefix (48 new tokens).

Random models have nearly tied logits, so two correct backends disagree somewhat: FLASH_ATTN vs TRITON_ATTN is
the yardstick, and TK must agree with FLASH_ATTN at least as well as TRITON_ATTN does (within a small noise
margin, printed with every number). Needs vLLM importable (GPU host: source /tmp/vllm_site/env.sh).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import vllm_harness as harness
from tests.gpu.vllm_harness import greedy_prefix, greedy_tokens, prompt_logprobs

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 64
GREEDY_TOKENS = 48
WORKER_TIMEOUT_S = 1200
# Noise margins for "at least as well as TRITON_ATTN": one agreement in ~200 positions, 25% on the worst logprob
# gap (a max over ~30k positions is itself noisy), and 10% on the mean greedy prefix.
TOP1_MARGIN = 0.005
MAX_DIFF_FACTOR, MAX_DIFF_SLACK = 1.25, 0.02
PREFIX_FACTOR = 0.9


def _prompts(vocab: int, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    low = 16  # keep clear of the special tokens
    shared = [rng.randrange(low, vocab) for _ in range(300)]
    prompts = []
    for i in range(NUM_PROMPTS):
        n = rng.choice([rng.randint(8, 64), rng.randint(65, 700), rng.randint(701, 1500)])
        tail = [rng.randrange(low, vocab) for _ in range(n)]
        prompts.append(shared + tail[:200] if i % 4 == 0 else tail)
    return prompts


# ------------------------------------------------------------------------------------------------- worker


def run_worker(model: str, backend: str, out: str, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto"
               ) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    vocab = len(AutoTokenizer.from_pretrained(model))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(vocab)]
    llm = LLM(
        model=model, attention_backend=backend, tensor_parallel_size=tensor_parallel_size, seed=0,
        max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=512, enable_chunked_prefill=True,
        enable_prefix_caching=True, gpu_memory_utilization=0.1, kv_cache_memory_bytes=harness.E2E_KV_CACHE_BYTES,
        enforce_eager=False, kv_cache_dtype=kv_cache_dtype,
    )
    token_logprobs, top1 = prompt_logprobs(llm, prompts)
    first = greedy_tokens(llm, prompts, GREEDY_TOKENS)
    second = greedy_tokens(llm, prompts, GREEDY_TOKENS)  # prefix-cache hits
    name = f"{backend}@tp{tensor_parallel_size}" + ("" if kv_cache_dtype == "auto" else f"/{kv_cache_dtype}")
    Path(out).write_text(json.dumps({"name": name, "token_logprobs": token_logprobs,
                                     "top1": top1, "greedy": first, "greedy_cached": second}))


def _jobs(model_dir: Path, out_dir: Path, *engines: tuple) -> list[tuple[Path, list[str], dict[str, str]]]:
    """run_workers' jobs for each (backend, tensor_parallel_size[, kv_cache_dtype]) engine."""
    jobs = []
    for backend, tp, *cache in engines:
        kv_cache_dtype = cache[0] if cache else "auto"
        suffix = "" if kv_cache_dtype == "auto" else f"_{kv_cache_dtype}"
        out = out_dir / f"{backend}_tp{tp}{suffix}.json"
        # TK takes the harder start method: spawned processes unpickle the config before loading plugins.
        env = harness.vllm_env(**({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if backend == "TK" else {}))
        command = [sys.executable, "-m", "tests.gpu.test_vllm_e2e", "--worker", "--model", str(model_dir),
                   "--backend", backend, "--out", str(out), "--tp", str(tp), "--kv-cache-dtype", kv_cache_dtype]
        jobs.append((out, command, env))
    return jobs


def _run(model_dir: Path, out_dir: Path, *engines: tuple) -> list[dict]:
    """The results of each (backend, tensor_parallel_size) engine, the missing ones run at once."""
    return harness.run_workers(_jobs(model_dir, out_dir, *engines), cwd=REPO, timeout_s=WORKER_TIMEOUT_S)


# ------------------------------------------------------------------------------------------------ metrics


def assert_agrees_like_yardstick(candidate: tuple[dict, dict], yardstick: tuple[dict, dict]) -> str:
    """The candidate pair agrees at least as well as the yardstick pair (two correct implementations) does."""
    a = candidate[0]
    cached = f" | {a['name']} with vs without prefix-cache hits: greedy prefix " \
             f"{greedy_prefix(a, a, 'greedy', 'greedy_cached'):.1f}"
    return harness.assert_agrees_like_yardstick(
        candidate, yardstick, greedy_tokens=GREEDY_TOKENS, top1_margin=TOP1_MARGIN, max_diff_factor=MAX_DIFF_FACTOR,
        max_diff_slack=MAX_DIFF_SLACK, prefix_factor=PREFIX_FACTOR, extra=cached)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return harness.workdir(tmp_path_factory, "vllm_e2e")


def _model(workdir: Path, preset: str) -> Path:
    sys.path.insert(0, str(REPO / "examples"))
    from build_tiny_model import build

    return build(workdir / preset, preset=preset)


TP1_ENGINES = (("FLASH_ATTN", 1), ("TRITON_ATTN", 1), ("TK", 1))
FP8_ENGINES = (("FLASH_ATTN", 1, "fp8"), ("TRITON_ATTN", 1, "fp8"), ("TK", 1, "fp8"))  # FP8 (e4m3) KV caches
TP2_ENGINES = (("FLASH_ATTN", 2), ("TRITON_ATTN", 2), ("TK", 2), ("TK", 1), ("FLASH_ATTN", 1))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _needs_gpus(n: int) -> None:
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs (nvidia-h200-x{n})")


@pytest.fixture(scope="module", autouse=True)
def _engines_at_once(request, workdir):
    """Every selected agreement test's engines start together (harness.prelaunch)."""
    engines = {"test_tk_agrees_with_flash_attn_at_least_as_well_as_triton": TP1_ENGINES,
               "test_fp8_cache_tk_agrees_with_flash_attn_at_least_as_well_as_triton": FP8_ENGINES,
               "test_tensor_parallel_2_agrees_with_tp1_and_flash_attn": TP2_ENGINES if _gpus() >= 2 else ()}

    def plan(item):
        preset = getattr(item, "callspec", None) and item.callspec.params.get("preset")
        wanted = engines.get(item.originalname, ())
        return _jobs(_model(workdir, preset), workdir / preset, *wanted) if preset and wanted else []

    harness.prelaunch(request, plan, REPO, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("preset", ["tiny-hd128", "tiny-hd64"])
def test_tk_agrees_with_flash_attn_at_least_as_well_as_triton(workdir, preset):
    model = _model(workdir, preset)
    fa, triton, tk = _run(model, workdir / preset, *TP1_ENGINES)
    assert_agrees_like_yardstick((tk, fa), (triton, fa))


@pytest.mark.parametrize("preset", ["tiny-hd128"])
def test_fp8_cache_tk_agrees_with_flash_attn_at_least_as_well_as_triton(workdir, preset):
    """--kv-cache-dtype fp8: every backend reads the same e4m3 cache (vLLM's writes), so the yardstick is
    TRITON_ATTN on fp8 against FLASH_ATTN on fp8."""
    model = _model(workdir, preset)
    fa, triton, tk = _run(model, workdir / preset, *FP8_ENGINES)
    assert_agrees_like_yardstick((tk, fa), (triton, fa))


# KV heads split evenly over the ranks (8 -> 4 + 4); fewer KV heads than ranks (1, replicated by vLLM).
@pytest.mark.parametrize("preset", ["tiny-hd128", "tiny-hd128-mqa"])
def test_tensor_parallel_2_agrees_with_tp1_and_flash_attn(workdir, preset):
    _needs_gpus(2)
    model = _model(workdir, preset)
    fa, triton, tk, tk_tp1, fa_tp1 = _run(model, workdir / preset, *TP2_ENGINES)
    assert_agrees_like_yardstick((tk, fa), (triton, fa))
    # TP 2 changes more than attention (the row-parallel layers' all-reduce sums in another order), so TK's
    # TP 2 vs TP 1 is held to what the same change does to FLASH_ATTN.
    assert_agrees_like_yardstick((tk, tk_tp1), (fa, fa_tp1))


@pytest.mark.parametrize("tp", [1, 2])
def test_openai_server_answers_on_tk(workdir, tp):
    _needs_gpus(tp)
    out = workdir / f"serve_tp{tp}.json"
    proc = subprocess.run([sys.executable, "scripts/serve_demo.py", "--preset", "tiny-hd64", "--json", str(out),
                           "--tensor-parallel-size", str(tp)],
                          cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(out.read_text())
    assert results["tensor_parallel_size"] == tp
    assert results["completion"]["tokens"] > 0 and results["chat"]["tokens"] > 0
    assert results["burst"]["tok_s"] > 0
    print(proc.stdout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    run_worker(args.model, args.backend, args.out, args.tp, args.kv_cache_dtype)
