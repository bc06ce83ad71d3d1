"""End to end on an H200 with vLLM (0.26.0 on the GPU host): a Mamba-2 model served with TK's SSD ops
(tk_backend.vllm.mamba) against vLLM's own Triton path, and the two hybrids cut down (Nemotron-H's layer pattern
with 8 groups of state 128, Falcon-H1's attention beside state-256 Mamba-2 in every layer; HYBRIDS), whose TK
path runs TK's attention too.

Each path serves the same random-weight model (examples/build_tiny_mamba2.py; the hybrids:
examples/build_model_configs.py with weights) and the same 48
random prompts in its own process (python -m tests.gpu.test_vllm_mamba_e2e --worker ...), with CUDA graphs
on (decode runs in captured full graphs), chunked prefill with a 512-token step budget (prompts up to 1500
tokens, so long prompts continue from the cached SSM state over several steps, packed with other requests)
and prefix caching off (vLLM 0.26's Mamba prefix caching is experimental and its default "all" mode asks
for per-chunk states, which TK hands back to Triton). Measured:

* teacher-forced: prompt logprobs at every position; top-1 agreement and the largest |logprob difference|
  of the prompt token;
* free-running: the length of the identical greedy prefix (48 new tokens).

Anchor and yardstick: a third worker serves the same model in float32 on vLLM's Triton path (TK declines
float32, so this is Triton throughout), the accuracy anchor. TK in bfloat16 must agree with the float32
anchor at least as well as Triton in bfloat16 does, within the noise margins below (why not TK against
Triton directly: docs/findings/serving.md#mamba-e2e-yardstick; TK vs Triton is still printed). Every number is
printed.

The engine runs in the worker's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the worker can read
tk_backend.vllm.mamba.STATS and the test checks which path actually ran: no fallback in the TK worker,
none of TK's ops in the Triton worker. One preset turns TK on with TK_MAMBA=1 (TK's scan and update), the
other with `attention_backend="TK"` (TK's scan; the decode update stays on vLLM's kernel). Needs vLLM importable (GPU host: source
/tmp/vllm_site/env.sh). The presets' engines start together (harness.prelaunch, 8 at a time; `-k` picks presets).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest

from tests.gpu import vllm_harness as harness
from tests.gpu.vllm_harness import greedy_prefix, greedy_tokens, prompt_logprobs, teacher_forced

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 48
GREEDY_TOKENS = 48
WORKER_TIMEOUT_S = 900
TOP1_MARGIN = 0.01  # the margins of tests/gpu/test_vllm_based_e2e.py (also an fp32-anchored comparison)
MAX_DIFF_FACTOR, MAX_DIFF_SLACK = 1.5, 0.05
PREFIX_FACTOR = 0.8


def _prompts(vocab: int, seed: int = 4321) -> list[list[int]]:
    rng = random.Random(seed)
    low = 16  # keep clear of the special tokens
    edges = [1, 2, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1024]  # kernel chunk (64), vLLM chunk (256), budget
    lengths = edges + [rng.choice([rng.randint(3, 64), rng.randint(65, 700), rng.randint(701, 1500)])
                       for _ in range(NUM_PROMPTS - len(edges))]
    rng.shuffle(lengths)
    return [[rng.randrange(low, vocab) for _ in range(n)] for n in lengths]


# ------------------------------------------------------------------------------------------------- worker


def run_worker(model: str, path: str, enable: str, out: str) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    vocab = len(AutoTokenizer.from_pretrained(model))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(vocab)]
    extra = {"attention_backend": "TK"} if path == "tk" and enable == "backend" else {}
    if path == "triton32":
        extra["dtype"] = "float32"
    llm = LLM(
        model=model, seed=0, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=512,
        enable_chunked_prefill=True, enable_prefix_caching=False, gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=harness.E2E_KV_CACHE_BYTES, enforce_eager=False,
        **extra,
    )
    token_logprobs, top1 = prompt_logprobs(llm, prompts)
    result = {"name": path, "token_logprobs": token_logprobs, "top1": top1, "greedy": greedy_tokens(llm, prompts, GREEDY_TOKENS)}
    from tk_backend.vllm import mamba as tk_mamba

    result["stats"] = dict(tk_mamba.STATS)
    Path(out).write_text(json.dumps(result))


PATHS = ("triton32", "triton", "tk")


def _jobs(model_dir: Path, enable: str, out_dir: Path, *paths: str) -> list[tuple[Path, list[str], dict[str, str]]]:
    """run_workers' jobs for each path's engine."""
    jobs = []
    for path in paths:
        out = out_dir / f"{path}_{enable}.json"
        env = harness.vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")  # engine in this process: STATS readable
        env.pop("TK_MAMBA", None)
        if path in ("triton", "triton32"):
            env["TK_MAMBA"] = "0"
        elif enable == "env":
            env["TK_MAMBA"] = "1"
        command = [sys.executable, "-m", "tests.gpu.test_vllm_mamba_e2e", "--worker", "--model", str(model_dir),
                   "--path", path, "--enable", enable, "--out", str(out)]
        jobs.append((out, command, env))
    return jobs


def _run(model_dir: Path, enable: str, out_dir: Path, *paths: str) -> list[dict]:
    """The results of each path's engine, the missing ones run at once (harness.run_workers)."""
    jobs = _jobs(model_dir, enable, out_dir, *paths)
    results = harness.run_workers(jobs, cwd=REPO, timeout_s=WORKER_TIMEOUT_S)
    for out, _, _ in jobs:
        log = out.with_suffix(".log")
        tk_lines = [line for line in log.read_text(errors="replace").splitlines() if "tk_backend" in line] \
            if log.exists() else []
        print(f"{out.stem} worker's tk_backend log lines:", *tk_lines[:10], sep="\n  ")
    return results


# ------------------------------------------------------------------------------------------------ metrics


def assert_as_accurate_as_triton(tk: dict, triton: dict, fp32: dict) -> str:
    """TK (bf16) vs the float32 anchor at least as close as Triton (bf16) vs the anchor, within the margins."""
    top1, diff = teacher_forced(tk, triton)
    extra = (f" | TK vs Triton (both bf16): top-1 {top1:.4f}, max |dlogprob| {diff:.4f}, greedy prefix "
             f"{greedy_prefix(tk, triton):.1f}/{GREEDY_TOKENS} | TK stats {tk['stats']} | Triton stats {triton['stats']}")
    return harness.assert_agrees_like_yardstick(
        (tk, fp32), (triton, fp32), greedy_tokens=GREEDY_TOKENS, top1_margin=TOP1_MARGIN,
        max_diff_factor=MAX_DIFF_FACTOR, max_diff_slack=MAX_DIFF_SLACK, prefix_factor=PREFIX_FACTOR, extra=extra)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return harness.workdir(tmp_path_factory, "vllm_mamba_e2e")


# The hybrids' shapes cut down (examples/build_model_configs.py's presets, their first layers, 1024 wide, a 4096-token
# vocabulary): what they keep is what the SSD path sees, Nemotron-H's 8 groups of state 128 between attention and
# MLP layers, Falcon-H1's state 256 beside attention in every layer. (preset, layers, overrides)
HYBRIDS = {
    "nemotron-h-tiny": ("nemotron-h-8b", 10, dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                                                  num_key_value_heads=2, mamba_num_heads=32, vocab_size=4096)),
    "falcon-h1-tiny": ("falcon-h1-1.5b", 4, dict(hidden_size=1024, intermediate_size=2048, mamba_d_ssm=2048,
                                                 mamba_n_heads=32, vocab_size=4096)),
}
HYBRID_LM_HEAD_SCALE = 5.0  # transformers' 0.02 initializer gives logits of std ~0.6; x5: ~3, as the Mamba-2 presets


def _model(workdir: Path, preset: str) -> Path:
    sys.path.insert(0, str(REPO / "examples"))
    if preset in HYBRIDS:
        from build_model_configs import build as build_hybrid

        release, layers, overrides = HYBRIDS[preset]
        return build_hybrid(workdir / preset, release, layers, tokenizer=True, weights=True,
                            lm_head_scale=HYBRID_LM_HEAD_SCALE, **overrides)
    from build_tiny_mamba2 import build

    return build(workdir / preset, preset=preset)


def _state_size(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return config.get("ssm_state_size") or config.get("mamba_d_state") or config["state_size"]


@pytest.fixture(scope="module", autouse=True)
def _engines_at_once(request, workdir):
    """Every selected preset's engines start together (harness.prelaunch)."""
    def plan(item):
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if "preset" not in params:
            return []
        return _jobs(_model(workdir, params["preset"]), params["enable"], workdir / params["preset"], *PATHS)

    harness.prelaunch(request, plan, REPO, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("preset, enable", [("mamba2-n128-g8", "env"), ("mamba2-n64-g1", "backend"),
                                            ("nemotron-h-tiny", "backend"), ("falcon-h1-tiny", "backend")])
def test_tk_ssd_agrees_with_vllm_triton_like_two_correct_paths(workdir, preset, enable):
    """The hybrids run TK's attention too (attention_backend TK). What runs where follows tk_backend.vllm.mamba:
    every scan on TK's kernels; the decode update on TK's under TK_MAMBA=1, otherwise only where tk_update_faster
    says (Falcon-H1's state 256 at batches of 32 and up: the captured graphs'), on vLLM's Triton kernel elsewhere."""
    from tk_backend.vllm import mamba as tk_mamba

    model = _model(workdir, preset)
    fp32, triton, tk = _run(model, enable, workdir / preset, *PATHS)
    stats_tk = tk["stats"]
    state_size = _state_size(model)
    assert stats_tk.get("tk_scan", 0) > 0, f"TK's scan did not run in the TK worker (TK on by {enable}): {stats_tk}"
    if enable == "env" or state_size == 256:  # TK_MAMBA=1, or the shapes where TK's update is the faster one
        assert stats_tk.get("tk_update", 0) > 0, f"TK's update did not run (TK on by {enable}): {stats_tk}"
    else:  # following the attention backend, the update stays on vLLM's (faster) Triton kernel
        assert stats_tk.get("tk_update", 0) == 0 and stats_tk.get("vllm_update", 0) > 0, \
            f"the decode update should stay on vLLM's kernel without TK_MAMBA=1: {stats_tk}"
    assert stats_tk.get("fallback_scan", 0) == 0 and stats_tk.get("fallback_update", 0) == 0, \
        f"TK fell back to Triton (TK's scan takes state sizes {tk_mamba.STATE_DIMS}): {stats_tk}"
    for other in (triton, fp32):
        assert other["stats"].get("tk_scan", 0) == 0 and other["stats"].get("tk_update", 0) == 0, \
            f"TK's ops ran in the {other['name']} worker: {other['stats']}"
    assert_as_accurate_as_triton(tk, triton, fp32)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", choices=["tk", "triton", "triton32"], required=True)
    parser.add_argument("--enable", choices=["env", "backend"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run_worker(args.model, args.path, args.enable, args.out)
