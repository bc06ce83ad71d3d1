"""Serving family: vLLM offline throughput (output tokens per second) per attention backend.

A Llama-3-8B-shaped model cut to 4 layers (examples/build_tiny_model.py preset llama3-8b-4l: hidden 4096,
32 q / 8 kv heads of 128, random weights, tokenizer trained locally), CUDA graphs on. Each backend runs in its
own process (`python scripts/benches/serve.py --worker ...`), all with the same random prompts and
ignore_eos, so every impl produces the same number of tokens; a short warm-up generate comes first, then
REPEATS timed runs of each case (the row is their median; every run's seconds are kept in runs_s, so the
spread between runs sits beside the ratio). Impls: tk (--attention-backend TK), flash_attn (FLASH_ATTN, FA3 on sm90), triton_attn (TRITON_ATTN);
TK_SERVE_IMPLS=tk,flash_attn runs a subset.

Cases: offline_512x1024in_256out (prefill-heavy) and offline_64x128in_1024out (decode-heavy). With
TK_SERVE_TP=2 the engines run tensor parallel 2 and the case names get the suffix _tp2.
Needs vLLM importable (GPU host: source /tmp/vllm_site/env.sh); otherwise the family is skipped with a reason.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CASES = {"offline_512x1024in_256out": (512, 1024, 256), "offline_64x128in_1024out": (64, 128, 1024)}
IMPLS = {"tk": "TK", "flash_attn": "FLASH_ATTN", "triton_attn": "TRITON_ATTN"}
PRESET = "llama3-8b-4l"
WORKER_TIMEOUT_S = 900
REPEATS = 3  # timed runs per case; the row is their median, all runs are kept


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(count)]


def build_model() -> Path:
    """The bench's model directory (built once, then reused)."""
    sys.path.insert(0, str(REPO / "examples"))
    from build_tiny_model import build

    return build(Path(tempfile.gettempdir()) / f"tk_serve_{PRESET}", preset=PRESET)


def engine(model: str, backend: str, tp: int, **extra):
    """An LLM with the bench's settings (CUDA graphs on, no prefix caching), and the model's vocabulary size."""
    from transformers import AutoTokenizer
    from vllm import LLM

    llm = LLM(model=model, attention_backend=backend, tensor_parallel_size=tp, seed=0, max_model_len=2048,
              max_num_seqs=256, gpu_memory_utilization=0.6, enable_prefix_caching=False, enforce_eager=False,
              **extra)
    return llm, len(AutoTokenizer.from_pretrained(model))


def case_inputs(case: str, vocab: int):
    """A case's prompts (the same random tokens for every backend) and sampling parameters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    count, length, new = CASES[case]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(count, length, vocab, seed=7)]
    return prompts, SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)


def worker(model: str, backend: str, tp: int, out: str, cases: list[str], repeats: int = REPEATS) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, vocab = engine(model, backend, tp)
    warm = [TokensPrompt(prompt_token_ids=p) for p in _prompts(16, 64, vocab, seed=1)]
    llm.generate(warm, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0), use_tqdm=False)
    results = {}
    for case in cases:
        prompts, params = case_inputs(case, vocab)
        runs, tokens = [], set()
        for _ in range(repeats):  # the first run also meets this case's batch shapes for the first time
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(time.perf_counter() - start)
            tokens.add(sum(len(o.outputs[0].token_ids) for o in outputs))
        assert len(tokens) == 1, f"{case}: runs produced different token counts {sorted(tokens)}"
        results[case] = {"seconds": statistics.median(runs), "runs": runs, "tokens": tokens.pop()}
    Path(out).write_text(json.dumps(results))


def run(quick: bool = False) -> list:
    from benchlib import Row
    from serve_demo import vllm_env

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"serve: skipped (vLLM is not importable: {exc}; GPU host: source /tmp/vllm_site/env.sh)", flush=True)
        return []
    tp = int(os.environ.get("TK_SERVE_TP", "1"))
    suffix = f"_tp{tp}" if tp > 1 else ""
    cases = list(CASES)[1:] if quick else list(CASES)
    model = build_model()
    env = vllm_env()
    only = [i for i in os.environ.get("TK_SERVE_IMPLS", "").split(",") if i]
    unknown = sorted(set(only) - set(IMPLS))
    if unknown:
        raise SystemExit(f"TK_SERVE_IMPLS names unknown impls {unknown}; choose from {sorted(IMPLS)}")
    rows = []
    for impl, backend in IMPLS.items():
        if only and impl not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "serve.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(model),
                       "--backend", backend, "--tp", str(tp), "--out", str(out), *cases]
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=WORKER_TIMEOUT_S)
            if proc.returncode != 0 or not out.exists():
                print(f"serve: {impl} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
                continue
            for case, r in json.loads(out.read_text()).items():
                rows.append(Row("serve", case + suffix, impl, r["seconds"] * 1e3,
                                extra={"tok_s": round(r["tokens"] / r["seconds"], 1), "tokens": r["tokens"],
                                       "runs_s": [round(x, 3) for x in r["runs"]]}))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    worker(args.model, args.backend, args.tp, args.out, args.cases)
