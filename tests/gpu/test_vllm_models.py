"""End to end on an H200 with vLLM (0.26.0 on the GPU host): the model shapes the TK backend used to refuse, each
served by TK, FLASH_ATTN and a yardstick backend from a config.json alone (examples/build_model_configs.py):

* Phi-3-mini (Phi3ForCausalLM): 32 heads of 96, a 2047-token sliding window;
* gpt-oss-20b (GptOssForCausalLM): 64 q / 8 kv heads of 64, attention sinks, 128-token windows on every other
  layer, a 32-expert MoE (vLLM's MoE kernels: on the GPU host the offline bundle's addon_moe);
* a bge-base-shaped BERT embedding model (BertModel, vLLM's pooling runner): encoder-only attention, 12 heads of 64;
* and a shape TK refuses (head size 100), to check that the refusal is TK's one sentence.

Each engine runs in its own process (python -m tests.gpu.test_vllm_models --worker ...; the file's engines start
together), with load_format="dummy" (nothing downloaded), prompts as token ids (skip_tokenizer_init=True), CUDA
graphs, and the same fixed kv_cache_memory_bytes for every engine. vLLM's dummy weights are uniform in
[-1e-3, 1e-3]: every norm's weight ~1e-3, so every score ~0 and every attention row an average, which would hide a
wrong mask. Each worker therefore redraws the weights before its first request (realistic_weights, through
LLM.apply_model: norms ~1, matrices ~1/sqrt(fan-in), sinks of gpt-oss's magnitude), seeded by each parameter's
name, so every backend serves the same model.

Measured as in test_vllm_e2e.py: for the decoders, teacher-forced top-1 agreement and the largest |logprob
difference| over every prompt position, and the identical greedy prefix; TK must agree with FLASH_ATTN at least as
well as TRITON_ATTN does (within noise margins, printed with every number). For the embedding model, 1 - cosine
similarity of the pooled embeddings; TK vs FLASH_ATTN at least as close as the other backend (TRITON_ATTN, else
FLEX_ATTENTION) vs FLASH_ATTN.

    source /tmp/vllm_site/env.sh && python3 -m pytest -q -s tests/gpu/test_vllm_models.py
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest

from tests.gpu import vllm_harness as harness
from tests.gpu.vllm_harness import greedy_tokens, prompt_logprobs

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 900
KV_CACHE_BYTES = 2 << 30  # every engine's, fixed: the file's engines share one GPU
GREEDY_TOKENS = 24
# Noise margins for "at least as well as the yardstick": a few agreements in ~6000 positions, 25% on the worst
# logprob gap, 20% on the mean greedy prefix (12 prompts: a noisier mean than test_vllm_e2e's 64).
TOP1_MARGIN = 0.01
MAX_DIFF_FACTOR, MAX_DIFF_SLACK = 1.25, 0.02
PREFIX_FACTOR = 0.8
# Embeddings: 1 - cos of two correct backends is ~1e-5..1e-3 in bf16; the slack covers the smallest of those.
EMBED_MEAN_FACTOR, EMBED_MAX_FACTOR, EMBED_SLACK = 1.5, 2.0, 1e-4

# preset -> how its engines run: the layers kept (build_model_configs' --layers), the runner, the context.
MODELS = {
    "phi3-mini": dict(layers=4, pooling=False, max_model_len=2048, num_prompts=12),
    "gpt-oss-20b": dict(layers=4, pooling=False, max_model_len=2048, num_prompts=12),
    # vLLM's pooling runner will not start with skip_tokenizer_init: this one gets a locally trained tokenizer.
    "bge-base": dict(layers=12, pooling=True, max_model_len=512, num_prompts=32, tokenizer=True),
    # Head size 100 (hidden 3200 over 32 heads): what TK refuses, to read its refusal.
    "phi3-hd100": dict(layers=2, pooling=False, max_model_len=2048, num_prompts=2, preset="phi3-mini",
                       overrides=dict(hidden_size=3200)),
}
DECODER_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "TK")
EMBEDDING_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TK")
HD100_REFUSAL = ("the TK attention backend (--attention-backend TK) cannot run this model: head_size 100 is not "
                 "supported (TK: multiples of 8 up to 256); choose another backend, for example --attention-backend "
                 "FLASH_ATTN")


def _prompts(vocab: int, num_prompts: int, max_len: int, seed: int = 1234) -> list[list[int]]:
    """Random token ids: short, medium and long prompts (past gpt-oss's 128-token window), every fourth sharing a
    200-token prefix (prefix-cache hits for the decoders)."""
    rng = random.Random(seed)
    low = 16  # keep clear of special tokens
    shared = [rng.randrange(low, vocab) for _ in range(200)]
    prompts = []
    for i in range(num_prompts):
        n = rng.choice([rng.randint(8, 64), rng.randint(65, max_len // 3), rng.randint(max_len // 3, max_len)])
        tail = [rng.randrange(low, vocab) for _ in range(n)]
        prompts.append((shared + tail)[:max_len] if i % 4 == 0 else tail)
    return prompts


# ------------------------------------------------------------------------------------------------- worker


def realistic_weights(model) -> int:
    """Redraw every floating-point parameter in place (runs inside the worker, through LLM.apply_model; pickled
    by value, so self-contained): 1-D weights (norms) ~ N(1, 0.1), 1-D biases ~ N(0, 0.02), attention sinks
    ~ N(0, 2) (gpt-oss's trained sinks are logits of that size), matrices ~ N(0, 1/fan_in) with fan-in their last
    dimension, the LM head 4x that (less tied logits, as examples/build_tiny_model.py). Seeded by the parameter's
    name: every backend's engine gets the same weights. Returns how many parameters it drew."""
    import zlib

    import torch

    drawn = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            gen = torch.Generator(device=param.device).manual_seed(zlib.crc32(name.encode()))
            if name.endswith("sinks"):
                param.normal_(0.0, 2.0, generator=gen)
            elif param.dim() == 1:
                param.normal_(1.0, 0.1, generator=gen) if name.endswith("weight") else param.normal_(
                    0.0, 0.02, generator=gen)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5 * (4.0 if "lm_head" in name else 1.0), generator=gen)
            drawn += 1
    return drawn


def run_worker(model: str, name: str, backend: str, out: str) -> None:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    spec = MODELS[name]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    with_tokenizer = spec.get("tokenizer", False)
    if with_tokenizer:  # token ids the tokenizer knows (vLLM checks them against it)
        from transformers import AutoTokenizer

        vocab = min(vocab, len(AutoTokenizer.from_pretrained(model)))
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in _prompts(vocab, spec["num_prompts"], spec["max_model_len"] - GREEDY_TOKENS - 2)]
    pooling = spec["pooling"]
    llm = LLM(
        model=model, attention_backend=backend, load_format="dummy", skip_tokenizer_init=not with_tokenizer, seed=0,
        dtype="bfloat16", max_model_len=spec["max_model_len"], max_num_seqs=16,
        max_num_batched_tokens=2048 if pooling else 512, enable_chunked_prefill=not pooling,
        enable_prefix_caching=not pooling, gpu_memory_utilization=0.1, kv_cache_memory_bytes=KV_CACHE_BYTES,
        enforce_eager=False, **({"runner": "pooling"} if pooling else {}),
    )
    drawn = llm.apply_model(realistic_weights)
    results = {"name": backend, "weights_drawn": drawn}
    if pooling:
        results["embeddings"] = harness.embeddings(llm, prompts)
    else:
        results["token_logprobs"], results["top1"] = prompt_logprobs(llm, prompts)
        results["greedy"] = greedy_tokens(llm, prompts, GREEDY_TOKENS)
    Path(out).write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------- driver


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return harness.workdir(tmp_path_factory, "vllm_models")


def _model(workdir: Path, name: str) -> Path:
    sys.path.insert(0, str(REPO / "examples"))
    from build_model_configs import build

    spec = MODELS[name]
    return build(workdir / name / "model", spec.get("preset", name), spec["layers"], spec.get("tokenizer", False),
                 **spec.get("overrides", {}))


def _jobs(workdir: Path, name: str, backends) -> list[tuple[Path, list[str], dict[str, str]]]:
    model = _model(workdir, name)
    jobs = []
    for backend in backends:
        out = workdir / name / f"{backend}.json"
        # TK takes the harder start method: spawned processes unpickle the config before loading plugins.
        env = harness.vllm_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # apply_model's function goes by pickle
                               **({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if backend == "TK" else {}))
        command = [sys.executable, "-m", "tests.gpu.test_vllm_models", "--worker", "--model", str(model),
                   "--name", name, "--backend", backend, "--out", str(out)]
        jobs.append((out, command, env))
    return jobs


# test -> (model, its engines)
ENGINES = {
    "test_phi3_mini_head_size_96_agrees_with_flash_attn_at_least_as_well_as_triton": ("phi3-mini", DECODER_BACKENDS),
    "test_gpt_oss_sinks_and_windows_agree_with_flash_attn_at_least_as_well_as_triton":
        ("gpt-oss-20b", DECODER_BACKENDS),
    "test_bert_embeddings_agree_with_flash_attn_at_least_as_well_as_another_backend":
        ("bge-base", EMBEDDING_BACKENDS),
    "test_an_unsupported_model_is_refused_in_one_sentence_naming_tk": ("phi3-hd100", ("TK",)),
}


@pytest.fixture(scope="module", autouse=True)
def _prelaunched(request, workdir) -> dict[Path, str]:
    """Every selected test's engines start together (harness.prelaunch); returns the failures' reports."""

    def plan(item):
        wanted = ENGINES.get(item.originalname)
        return _jobs(workdir, *wanted) if wanted else []

    return harness.prelaunch(request, plan, REPO, WORKER_TIMEOUT_S)


def _results(request, workdir: Path, prelaunched: dict[Path, str]) -> dict[str, dict | str]:
    """The calling test's engines: backend -> its results, or the report of its failure (prelaunch's, else that of
    the run here)."""
    name, backends = ENGINES[request.node.originalname]
    jobs = _jobs(workdir, name, backends)
    todo = [job for job in jobs if job[0] not in prelaunched]
    done = dict(zip((job[0] for job in todo), harness.try_workers(todo, cwd=REPO, timeout_s=WORKER_TIMEOUT_S)))
    return {backend: done.get(job[0], prelaunched.get(job[0])) for backend, job in zip(backends, jobs)}


def _require(results: dict[str, dict | str], *backends: str) -> list[dict]:
    """The named backends' results; the test fails with the report of any that failed."""
    for backend in backends:
        if isinstance(results[backend], str):
            pytest.fail(results[backend], pytrace=False)
    return [results[b] for b in backends]


def _assert_agrees_like_triton(results: dict[str, dict | str]) -> str:
    fa, triton, tk = _require(results, "FLASH_ATTN", "TRITON_ATTN", "TK")
    return harness.assert_agrees_like_yardstick(
        (tk, fa), (triton, fa), greedy_tokens=GREEDY_TOKENS, top1_margin=TOP1_MARGIN,
        max_diff_factor=MAX_DIFF_FACTOR, max_diff_slack=MAX_DIFF_SLACK, prefix_factor=PREFIX_FACTOR)


def test_phi3_mini_head_size_96_agrees_with_flash_attn_at_least_as_well_as_triton(request, workdir, _prelaunched):
    _assert_agrees_like_triton(_results(request, workdir, _prelaunched))


def test_gpt_oss_sinks_and_windows_agree_with_flash_attn_at_least_as_well_as_triton(request, workdir,
                                                                                     _prelaunched):
    results = _results(request, workdir, _prelaunched)
    if isinstance(results["FLASH_ATTN"], str):
        last = [line for line in results["FLASH_ATTN"].splitlines() if line.strip()][-1:]
        pytest.skip("vLLM cannot serve gpt-oss-20b's shape on this host: FLASH_ATTN failed too (vLLM's MoE kernels "
                    "need the offline bundle's addon_moe: bash .offline-vllm/addon_moe/stage.sh); its last line: "
                    f"{last[0] if last else '(empty log)'}")
    _assert_agrees_like_triton(results)


def test_bert_embeddings_agree_with_flash_attn_at_least_as_well_as_another_backend(request, workdir, _prelaunched):
    results = _results(request, workdir, _prelaunched)
    fa, tk = _require(results, "FLASH_ATTN", "TK")
    others = [results[b] for b in ("TRITON_ATTN", "FLEX_ATTENTION") if not isinstance(results[b], str)]
    if not others:
        pytest.fail("no yardstick backend served the embedding model:\n\n" + results["TRITON_ATTN"] + "\n\n"
                    + results["FLEX_ATTENTION"], pytrace=False)
    assert len(tk["embeddings"]) == len(fa["embeddings"]) == MODELS["bge-base"]["num_prompts"]
    harness.assert_embeds_like_yardstick((tk, fa), (others[0], fa), mean_factor=EMBED_MEAN_FACTOR,
                                         max_factor=EMBED_MAX_FACTOR, slack=EMBED_SLACK)


def test_an_unsupported_model_is_refused_in_one_sentence_naming_tk(request, workdir, _prelaunched):
    """vLLM's own message would be "Selected backend AttentionBackendEnum.CUSTOM is not valid ...": TK's sentence
    reaches the user instead."""
    (report,) = _results(request, workdir, _prelaunched).values()
    assert isinstance(report, str), "the TK engine served a head size of 100"
    (out, _, _), = _jobs(workdir, *ENGINES[request.node.originalname])
    log = out.with_suffix(".log").read_text(errors="replace")  # the whole log: the refusal is in a traceback
    assert HD100_REFUSAL in log, report
    assert "AttentionBackendEnum.CUSTOM is not valid" not in log, report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", required=True, choices=sorted(MODELS))
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run_worker(args.model, args.name, args.backend, args.out)
