"""Serving family: vLLM throughput (and online latency) per attention backend, on a 4-layer model and on full-size
model shapes.

Models (TK_SERVE_MODELS=llama3.1-8b,qwen2.5-7b,... picks them, in that order; default llama3-8b-4l alone, the run
this family always made):

    llama3-8b-4l  Llama-3-8B's shapes cut to 4 layers (examples/build_tiny_model.py: random weights written out,
                  tokenizer trained locally); impls tk, flash_attn, triton_attn; 5 rounds
    llama3.1-8b   full size, from a config.json alone (examples/build_model_configs.py): vLLM draws random weights
    qwen2.5-7b    (load_format="dummy", nothing downloaded) and takes the prompts as token ids
    gemma2-9b     (skip_tokenizer_init=True); impls tk, flash_attn; 3 rounds; max_model_len 32768 (the long case's
    llama3.2-1b   24832 tokens, rounded up to a power of two). Gemma-2 (8192 positions) and Phi-3-mini (4096) are
    phi3-mini     built with 32768 positions so the long case fits; their windows (4096 on Gemma-2's even layers,
                  2047 on every Phi-3 layer) and all else are the release's.
    bge-base      a BERT embedding model (pooling runner; needs a tokenizer: a locally trained one, 4096 tokens, so
                  its prompts' ids stay below 4096); impls tk, flash_attn, triton_attn; 5 rounds; max_model_len 512
    mamba2-2.7b   Mamba-2 models and hybrids, full size from a config.json alone (dummy weights, token-id prompts);
    nemotron-h-8b impls tk (--attention-backend TK: TK's SSD scan, vLLM's decode update) and flash_attn (vLLM's
    falcon-h1-1.5b default: FLASH_ATTN and Triton SSD, TK_MAMBA=0); 3 rounds; max_model_len 16384 (the prefill case's 8256
                  tokens, rounded up; Nemotron-H built with 16384 positions), max_num_seqs 128 (the most sequences a
                  case holds: every Mamba engine keeps a state for each of max_num_seqs at start-up). Their own
                  cases (below); each run also records the worker's TK Mamba counters (tk_stats: the
                  tk_backend.vllm.mamba STATS of the engine's worker process, read by collective_rpc)

Cases, named `<model>_<kind>_<shape>` (the 4-layer model's keep their old names, with no model):

    kind         shape                           metric                      the 4-layer model's case
    prefill      128 x 2048 in, 32 out           output tok/s                offline_512x1024in_256out
    decode       128 x 512 in, 512 out           output tok/s                offline_64x128in_1024out
    long         8 x 24576 in, 256 out           output tok/s
    prefill_fp8  prefill over an fp8 KV cache    output tok/s (llama3.1-8b only; case name + _fp8)
    decode_fp8   decode over an fp8 KV cache     output tok/s (llama3.1-8b only; case name + _fp8)
    online       256 requests, 128-2048 in       TTFT and TPOT p50 / p99 (vLLM's OpenAI server)
                 (uniform), 256 out, 8 req/s
    embed        1024 prompts of 64-512 tokens   requests/s of pooled embeddings (llm.embed; bge-base)

The Mamba-2 models' cases (theirs alone):

    prefill      32 x 8192 in, 64 out            output tok/s
    decode       128 x 512 in, 512 out           output tok/s
    prefix       64 x (a shared 4096-token       output tok/s, prefix caching on (enable_prefix_caching, both
                 prefix + 512 distinct) in,      impls: engines of their own); the worker runs the first
                 64 out                          prompt once, untimed, before the case's first run, so every
                                                 timed run finds the prefix cached

e.g. llama3.1-8b_prefill_128x2048in_32out, llama3.1-8b_decode_128x512in_512out_fp8,
llama3.1-8b_online_256x128-2048in_256out_8rps, bge-base_embed_1024x64-512in, nemotron-h-8b_prefix_64x4096+512in_64out.
TK_SERVE_CASES=decode,long (kinds) or full case names picks among the selected models' cases; the default is every
case of kind prefill, decode, long, prefix and embed. The fp8 and online cases run only when named: each needs engines of its own, and with them a GPU call
of its own (below). --quick runs each model's decode (or embed) case. An unknown model, impl or case is refused
before anything starts.

How a comparison runs. Each impl's engine is its own process (`python scripts/benches/serve.py --worker ...`), all
with the same random prompts and ignore_eos, so every impl produces the same number of tokens (checked: a row
whose runs fall short is dropped with a message). The impls' engines start together and stay up, each with the
same fixed KV cache (kv_cache_memory_bytes, so none sizes its cache from memory the others are taking), then take
turns: round r runs each case once on every engine, one engine at a time, in an order that rotates each round. A
slow stretch of the host (the spread between runs of one engine reached 1.4x in earlier, sequential runs) then
falls on every impl alike. The row is the median of an impl's rounds; every run is kept (runs_s; online: runs).
A model's engines are grouped by what an engine is fixed to: its offline engines over the bf16 cache, its fp8
ones, its OpenAI servers; the groups run one after another. An engine that fails to start or dies is left out
with a message (and listed again at the end); the others carry on. Impls: tk (--attention-backend TK),
flash_attn (FLASH_ATTN, FA3 on sm90), triton_attn (TRITON_ATTN), flash_attn_full (FLASH_ATTN with
cudagraph_mode FULL: full graphs for mixed batches too; only where named); TK_SERVE_IMPLS=tk,flash_attn runs those for
every model instead of the model's own list, TK_SERVE_REPEATS=N N rounds for every model.

KV cache per engine: the 4-layer model's is 8 GiB. A full-size model's is its KV bytes a token (layers x K and V x
kv heads x head size x 2 bytes, 1 in fp8) times the largest peak of the group's cases (every case of the group,
selected or not, so a case's row does not depend on what else ran), x 1.1, rounded up to a GiB and capped at
40 GiB (two engines of the largest model, Gemma-2-9B's 17 GiB of weights, fit one H200 with that and their
activations and graphs). A case's peak: min(prompts, 256 sequences) x (longest prompt + output) tokens; online
64 requests in flight (the load's ~8/s x ~4 s a request, doubled); embed 16384 tokens (a step). Windows are not
counted (vLLM keeps only the window of a sliding layer), so windowed models hold more than this says. vLLM reads
kv_cache_memory_bytes per GPU: at TP 2 every engine holds twice the tokens. The caps assume two engines a GPU: a
third (TK_SERVE_IMPLS=tk,flash_attn,triton_attn) of an 8B model may not fit, and is then left out at start-up.

    model         KV a token  offline engines     online engines   impls x rounds   expected wall time (H200)
    llama3-8b-4l   16 KiB      8 GiB                                3 x 5            ~4 min
    llama3.1-8b   128 KiB     36 GiB (fp8: 18)     20 GiB           2 x 3            ~5 min; fp8 ~4 min; online ~7 min
    qwen2.5-7b     56 KiB     16 GiB                9 GiB           2 x 3            ~5 min; online ~7 min
    gemma2-9b     336 KiB     40 GiB (capped)      40 GiB (capped)  2 x 3            ~6 min; online ~7 min
    llama3.2-1b    32 KiB      9 GiB                5 GiB           2 x 3            ~3 min; online ~6 min
    phi3-mini     384 KiB     40 GiB (capped)      40 GiB (capped)  2 x 3            ~4 min; online ~7 min
    bge-base       36 KiB      1 GiB (no cache: encoder-only)       3 x 5            ~2 min
    mamba2-2.7b     0 KiB     12 GiB (prefix: 17)                   2 x 3            ~4 min
    nemotron-h-8b  16 KiB     18 GiB (prefix: 27)                   2 x 3            ~6 min
    falcon-h1-1.5b 24 KiB     14 GiB (prefix: 18)                   2 x 3            ~4 min

A Mamba-2 model's cache also holds its Mamba states (mamba_state_bytes: per sequence, every Mamba layer's conv
state, (conv kernel - 1) x (intermediate + 2 x groups x state) x 2 bytes, and SSM state, heads x head dim x state x
2 bytes, 4 for Nemotron-H, whose SSM cache vLLM keeps in float32). A case needs, for each sequence it holds, its
tokens' KV, its Mamba states (1; 3 with prefix caching: vLLM 0.33's "align" mode keeps two working states and a
prefill checkpoint a sequence; 0.26's "all" mode, not read here, keeps one a cached block, so its engines may hold
fewer prefix-case sequences at once, alike for both impls) and one more attention block each attention layer (vLLM
pads attention blocks to a Mamba state's size, so a sequence's last, partly filled block costs about a state);
the cache is at least max_num_seqs Mamba states (vLLM refuses to capture full decode graphs with fewer Mamba
blocks than max_num_seqs: the failure of issue 49), then x 1.1 and rounded up as above. The shared prefix is
counted in full for every sequence: an upper bound.

Capped caches bind the prefill case (Gemma-2 holds ~60 of its 128 sequences at once, Phi-3 ~50): alike for every
engine, and each full-size row carries its engines' kv_cache_gib. The wall times are estimates (two engines'
start, ~2-3 min with torch.compile and graph capture, plus rounds x impls x a run of ~8-11 s for an 8B model's
offline case, ~36 s for an online run), not yet measured: the GPU host's device calls last at most 10 minutes,
so run one model (and the fp8 or online cases) per call, e.g.

    source /tmp/vllm_site/env.sh
    TK_SERVE_MODELS=llama3.1-8b python3 scripts/bench.py --family serve
    TK_SERVE_MODELS=llama3.1-8b TK_SERVE_CASES=prefill_fp8,decode_fp8 python3 scripts/bench.py --family serve
    TK_SERVE_MODELS=llama3.1-8b TK_SERVE_CASES=online python3 scripts/bench.py --family serve
    TK_SERVE_MODELS=nemotron-h-8b python3 scripts/bench.py --family serve

Each call merges only its own cases' rows into bench/results/h200.json.

Online (vLLM's OpenAI server, `vllm serve` with the engine settings above, prompts as token ids with
--skip-tokenizer-init): requests arrive as a Poisson process at the case's rate (seeded, the same for every impl),
each a streamed /v1/completions with ignore_eos; TTFT is the time to the first streamed chunk, TPOT (latency -
TTFT) / (output tokens - 1), p50 and p99 over the run's requests, as `vllm bench serve` computes them. The row's
median_ms is the median over rounds of the run's TPOT p50; ttft_p50_ms, ttft_p99_ms, tpot_p50_ms and tpot_p99_ms
are the medians over rounds of each.

With TK_SERVE_TP=2 the engines run tensor parallel 2 and the case names get the suffix _tp2. TK_SERVE_MAX_MODEL_LEN
(default 2048) sets the 4-layer model's max_model_len, and so the width of vLLM's block table, which decode kernels
that plan from the table's width feel although the contexts stay at most 1280 tokens; other values add the suffix
_len<N> (a longer length builds the model with that many positions). Full-size models keep their own lengths.
TK_SERVE_LOG_DIR=DIR keeps every engine's log there (DIR/<model group>/<impl>.log), e.g. $OUT/serve_logs in a device
call; by default they live in a temporary folder that goes with the run.
Needs vLLM importable (GPU host: source /tmp/vllm_site/env.sh); otherwise the family is skipped with a reason.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import http.client
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# An impl's engine: the attention backend, and "+MODE" a cudagraph_mode of its own (vLLM's default is
# FULL_AND_PIECEWISE: full graphs for uniform decode batches, piecewise ones around attention for the rest).
# flash_attn_full is FLASH_ATTN with full graphs for mixed batches too, which TK's backend does not declare
# (AttentionCGSupport.UNIFORM_BATCH): beside flash_attn it measures what that mode pays a FLASH_ATTN user.
IMPLS = {"tk": "TK", "flash_attn": "FLASH_ATTN", "triton_attn": "TRITON_ATTN", "flash_attn_full": "FLASH_ATTN+FULL"}
BACKEND_IMPLS = ("tk", "flash_attn", "triton_attn")  # one a backend, at vLLM's default graphs
PRESET = "llama3-8b-4l"
STARTUP_TIMEOUT_S = 900  # an engine's start and warm-up
RUN_TIMEOUT_S = 600  # one timed run
MAX_MODEL_LEN = int(os.environ.get("TK_SERVE_MAX_MODEL_LEN", "2048"))  # the 4-layer model's
DEFAULT_POSITIONS = 8192  # build_tiny_model's max_position_embeddings
FULL_MAX_MODEL_LEN = 32768  # the full-size models': the long case's 24576 + 256 tokens, rounded up
MAMBA_MAX_MODEL_LEN = 16384  # the Mamba-2 models': the prefill case's 8192 + 64 tokens, rounded up
MAX_NUM_SEQS = 256
MAMBA_MAX_NUM_SEQS = 128  # the most sequences a Mamba-2 case holds; vLLM keeps a state for each at start-up
PREFIX_STATES = 3  # Mamba states a sequence holds with prefix caching (vLLM 0.33 "align": 2 + a prefill checkpoint)
GiB = 1 << 30
# Each 4-layer engine's KV cache: the largest case holds at most 256 sequences of 1280 tokens at once, 16 KiB a token
# (4 layers x K and V x 8 kv heads x 128 x 2 bytes): 5 GiB.
KV_CACHE_BYTES = 8 * GiB
KV_HEADROOM = 1.1
KV_CACHE_CAP_BYTES = 40 * GiB  # two engines of Gemma-2-9B (17 GiB of weights) and their activations fit one H200
ONLINE_PEAK_REQUESTS = 64  # requests in flight under the online load: ~8/s x ~4 s each, doubled
EMBED_BATCH_TOKENS = 16384  # the pooling engine's max_num_batched_tokens (no chunked prefill: a prompt fits a step)
DEFAULT_KINDS = ("prefill", "decode", "long", "prefix", "embed")
QUICK_KINDS = ("decode", "embed")
PROMPT_SEED = 7  # every case's prompts (and online arrivals): the same for every impl


@dataclass(frozen=True)
class ServeModel:
    name: str  # TK_SERVE_MODELS' name, and its cases' prefix
    preset: str  # build_tiny_model's preset (tiny) or build_model_configs'
    tiny: bool = False  # weights and tokenizer written out (build_tiny_model), not a config alone (dummy weights)
    max_model_len: int = FULL_MAX_MODEL_LEN
    impls: tuple[str, ...] = ("tk", "flash_attn")
    repeats: int = 3  # a full-size 8B model's round of cases takes minutes
    pooling: bool = False  # an embedding model (vLLM's pooling runner; needs a tokenizer)
    positions: int | None = None  # max_position_embeddings where the release has fewer than max_model_len
    kv_cache_bytes: int | None = None  # fixed; None: sized from the cases (kv_cache_bytes())
    max_num_seqs: int = MAX_NUM_SEQS
    mamba: bool = False  # has Mamba-2 layers: the Mamba cases, TK_MAMBA set per impl, TK's counters recorded


MODELS = {m.name: m for m in (
    ServeModel(PRESET, PRESET, tiny=True, max_model_len=MAX_MODEL_LEN, impls=BACKEND_IMPLS, repeats=5,
               kv_cache_bytes=KV_CACHE_BYTES),
    ServeModel("llama3.1-8b", "llama3.1-8b"),
    ServeModel("qwen2.5-7b", "qwen2.5-7b"),
    ServeModel("gemma2-9b", "gemma2-9b", positions=FULL_MAX_MODEL_LEN),
    ServeModel("llama3.2-1b", "llama3.2-1b"),
    ServeModel("phi3-mini", "phi3-mini", positions=FULL_MAX_MODEL_LEN),
    # A run takes about a second: more rounds cost little. Encoder-only layers keep no KV cache.
    ServeModel("bge-base", "bge-base", max_model_len=512, impls=BACKEND_IMPLS, repeats=5, pooling=True),
    ServeModel("mamba2-2.7b", "mamba2-2.7b", max_model_len=MAMBA_MAX_MODEL_LEN, max_num_seqs=MAMBA_MAX_NUM_SEQS,
               mamba=True),
    ServeModel("nemotron-h-8b", "nemotron-h-8b", max_model_len=MAMBA_MAX_MODEL_LEN, positions=MAMBA_MAX_MODEL_LEN,
               max_num_seqs=MAMBA_MAX_NUM_SEQS, mamba=True),
    ServeModel("falcon-h1-1.5b", "falcon-h1-1.5b", max_model_len=MAMBA_MAX_MODEL_LEN,
               max_num_seqs=MAMBA_MAX_NUM_SEQS, mamba=True),
)}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    kind: str  # prefill, decode, long, prefill_fp8, decode_fp8, online, embed, prefix
    prompts: int
    prompt_len: int | tuple[int, int]  # a range: each prompt's length drawn uniformly from it (inclusive)
    new_tokens: int = 0  # 0: embed
    kv_cache_dtype: str = "auto"
    rate: float = 0.0  # online: requests a second
    shared_prefix: int = 0  # tokens every prompt starts with (before its own prompt_len); prefix caching on

    @property
    def prefix_caching(self) -> bool:
        return self.shared_prefix > 0

    @property
    def online(self) -> bool:
        return self.kind == "online"

    @property
    def longest_prompt(self) -> int:
        return self.shared_prefix + (self.prompt_len if isinstance(self.prompt_len, int) else self.prompt_len[1])

    @property
    def peak_tokens(self) -> int:
        """The most tokens the case holds in the KV cache at once."""
        if self.kind == "embed":
            return EMBED_BATCH_TOKENS
        held = min(self.prompts, ONLINE_PEAK_REQUESTS if self.online else MAX_NUM_SEQS)
        return held * (self.longest_prompt + self.new_tokens)

    @property
    def expected_tokens(self) -> int:
        """Output tokens of a run (embed: prompt tokens), the same for every impl."""
        if self.kind == "embed":
            return sum(_lengths(self.prompts, self.prompt_len, random.Random(PROMPT_SEED)))
        return self.prompts * self.new_tokens


def _case(model: str, kind: str, prompts: int, prompt_len: int | tuple[int, int], new_tokens: int = 0,
          rate: float = 0.0, shared_prefix: int = 0) -> Case:
    """A case named <model>_<kind>_<prompts>x[<shared prefix>+]<len>in[_<new>out][_<rate>rps]."""
    length = f"{prompt_len[0]}-{prompt_len[1]}" if isinstance(prompt_len, tuple) else str(prompt_len)
    length = f"{shared_prefix}+{length}" if shared_prefix else length
    name = f"{model}_{kind}_{prompts}x{length}in" + (f"_{new_tokens}out" if new_tokens else "") + (
        f"_{rate:g}rps" if rate else "")
    return Case(name, model, kind, prompts, prompt_len, new_tokens, rate=rate, shared_prefix=shared_prefix)


def _fp8(case: Case) -> Case:
    return replace(case, name=case.name + "_fp8", kind=case.kind + "_fp8", kv_cache_dtype="fp8")


def _decoder_cases(model: str) -> list[Case]:
    cases = [_case(model, "prefill", 128, 2048, 32), _case(model, "decode", 128, 512, 512),
             _case(model, "long", 8, 24576, 256), _case(model, "online", 256, (128, 2048), 256, rate=8.0)]
    return cases + ([_fp8(c) for c in cases[:2]] if model == "llama3.1-8b" else [])


def _mamba_cases(model: str) -> list[Case]:
    return [_case(model, "prefill", 32, 8192, 64), _case(model, "decode", 128, 512, 512),
            _case(model, "prefix", 64, 512, 64, shared_prefix=4096)]


def _case_table() -> list[Case]:
    cases = [Case("offline_512x1024in_256out", PRESET, "prefill", 512, 1024, 256),
             Case("offline_64x128in_1024out", PRESET, "decode", 64, 128, 1024)]
    for m in MODELS.values():
        if m.pooling:
            cases += [_case(m.name, "embed", 1024, (64, 512))]
        elif m.mamba:
            cases += _mamba_cases(m.name)
        elif not m.tiny:
            cases += _decoder_cases(m.name)
    return cases


CASE_TABLE = _case_table()
ALL_CASES = {c.name: c for c in CASE_TABLE}
KINDS = tuple(dict.fromkeys(c.kind for c in CASE_TABLE))
# The 4-layer model's cases as (prompts, prompt tokens, new tokens), as scripts/profile_serve.py reads them.
CASES = {c.name: (c.prompts, c.prompt_len, c.new_tokens) for c in CASE_TABLE if c.model == PRESET}


# ------------------------------------------------------------------------------------------------ selection


def _names(variable: str) -> list[str]:
    return [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]


def selected_models() -> list[str]:
    """TK_SERVE_MODELS' models, in its order (default: the 4-layer model)."""
    names = _names("TK_SERVE_MODELS") or [PRESET]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"TK_SERVE_MODELS names unknown models {unknown}; choose from {list(MODELS)}")
    return list(dict.fromkeys(names))


def selected_cases(models: list[str], quick: bool = False) -> list[Case]:
    """The models' cases that TK_SERVE_CASES names (case names or kinds), in the models' order; default: the kinds
    DEFAULT_KINDS (--quick: QUICK_KINDS). A name matching no case of the models is refused."""
    pool = [c for m in models for c in CASE_TABLE if c.model == m]
    named = _names("TK_SERVE_CASES")
    if not named:
        kinds = QUICK_KINDS if quick else DEFAULT_KINDS
        return [c for c in pool if c.kind in kinds]
    unmatched = [n for n in named if not any(n in (c.name, c.kind) for c in pool)]
    if unmatched:
        raise SystemExit(f"TK_SERVE_CASES names {unmatched}, which match no case of the models run "
                         f"({','.join(models)}; TK_SERVE_MODELS picks them); choose kinds from {list(KINDS)} or "
                         f"cases from {[c.name for c in pool]}")
    return [c for c in pool if c.name in named or c.kind in named]


def selected_impls(model: str) -> list[str]:
    """TK_SERVE_IMPLS' impls (in IMPLS' order), else the model's own."""
    only = _names("TK_SERVE_IMPLS")
    unknown = sorted(set(only) - set(IMPLS))
    if unknown:
        raise SystemExit(f"TK_SERVE_IMPLS names unknown impls {unknown}; choose from {sorted(IMPLS)}")
    return [i for i in IMPLS if i in only] if only else list(MODELS[model].impls)


def rounds(model: str) -> int:
    return int(os.environ.get("TK_SERVE_REPEATS") or MODELS[model].repeats)


@dataclass(frozen=True)
class Group:
    """What an engine is fixed to: the model, its KV cache's dtype, whether it is an OpenAI server, and whether it
    caches prefixes."""
    model: str
    kv_cache_dtype: str = "auto"
    online: bool = False
    prefix_caching: bool = False

    @property
    def label(self) -> str:
        return f"{self.model}_{self.kv_cache_dtype}" + ("_online" if self.online else "") + (
            "_prefix" if self.prefix_caching else "")


def _group(case: Case) -> Group:
    return Group(case.model, case.kv_cache_dtype, case.online, case.prefix_caching)


def plan(cases: list[Case]) -> list[tuple[Group, list[Case]]]:
    """The cases by engine group, in the order they run: by model, then bf16 offline, prefix caching, fp8 offline,
    online."""
    groups: dict[Group, list[Case]] = {}
    for c in sorted(cases, key=lambda c: (c.online, c.kv_cache_dtype != "auto", c.prefix_caching)):
        groups.setdefault(_group(c), []).append(c)
    order = list(dict.fromkeys(c.model for c in cases))
    return sorted(groups.items(), key=lambda g: order.index(g[0].model))


# ------------------------------------------------------------------------------------------ engine settings


def _full_config(name: str):
    sys.path.insert(0, str(REPO / "examples"))
    from build_model_configs import config

    return config(MODELS[name].preset)


def _layer_counts(cfg) -> tuple[int, int]:
    """(attention layers, Mamba-2 layers) of a transformers config."""
    if cfg.model_type == "mamba2":
        return 0, cfg.num_hidden_layers
    if cfg.model_type == "nemotron_h":  # M a Mamba-2 layer, * attention, - an MLP
        return cfg.hybrid_override_pattern.count("*"), cfg.hybrid_override_pattern.count("M")
    if cfg.model_type == "falcon_h1":  # attention and Mamba-2 side by side in every layer
        return cfg.num_hidden_layers, cfg.num_hidden_layers
    return cfg.num_hidden_layers, 0


@functools.lru_cache(maxsize=None)
def model_shape(name: str) -> tuple[int, int, int]:
    """(layers, kv heads, head size) of the model's attention (layers: those with attention; (0, 0, 0): none)."""
    m = MODELS[name]
    if m.tiny:
        sys.path.insert(0, str(REPO / "examples"))
        from build_tiny_model import PRESETS

        shape = PRESETS[m.preset]
        return shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]
    cfg = _full_config(name)
    layers = _layer_counts(cfg)[0]
    if not layers:
        return 0, 0, 0
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


# model_type -> the config's names of a Mamba-2 layer's (heads, head dim, state, groups, conv kernel, SSM state bytes
# an element); the intermediate size is heads x head dim. vLLM keeps the conv state in the model's dtype (bf16) and
# the SSM state in it too, but for Nemotron-H, whose SSM cache it keeps in float32 (NemotronHForCausalLMConfig).
MAMBA_FIELDS = {
    "mamba2": ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", 2),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", 4),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", 2),
}


@functools.lru_cache(maxsize=None)
def mamba_state_bytes(name: str) -> int:
    """A sequence's Mamba states over every Mamba-2 layer, as vLLM's MambaStateShapeCalculator.mamba2_state_shape
    lays them out at TP 1: conv (conv kernel - 1) x (intermediate + 2 x groups x state), SSM heads x head dim x
    state (0: no Mamba layers)."""
    m = MODELS[name]
    if not m.mamba:
        return 0
    cfg = _full_config(name)
    heads, head_dim, state, groups, kernel, ssm_bytes = MAMBA_FIELDS[cfg.model_type]
    heads, head_dim, state, groups, kernel = (getattr(cfg, f) for f in (heads, head_dim, state, groups, kernel))
    conv = (kernel - 1) * (heads * head_dim + 2 * groups * state) * 2
    return _layer_counts(cfg)[1] * (conv + heads * head_dim * state * ssm_bytes)


def kv_bytes_per_token(name: str, kv_cache_dtype: str = "auto") -> int:
    """K and V of every layer: layers x 2 x kv heads x head size x (2 bytes; 1 in fp8)."""
    layers, kv_heads, head_dim = model_shape(name)
    return layers * 2 * kv_heads * head_dim * (1 if kv_cache_dtype.startswith("fp8") else 2)


def case_cache_bytes(case: Case) -> int:
    """The cache the case holds at its peak (the module docstring says what it counts)."""
    kv = case.peak_tokens * kv_bytes_per_token(case.model, case.kv_cache_dtype)
    states = mamba_state_bytes(case.model)
    if not states:
        return kv
    held = min(case.prompts, MODELS[case.model].max_num_seqs)
    layers = model_shape(case.model)[0]
    per_layer_state = states // _layer_counts(_full_config(case.model))[1]
    return kv + held * ((PREFIX_STATES if case.prefix_caching else 1) * states + layers * per_layer_state)


def kv_cache_bytes(group: Group) -> int:
    """Every engine of the group's kv_cache_memory_bytes (the module docstring says how it is sized)."""
    m = MODELS[group.model]
    if m.kv_cache_bytes is not None:
        return m.kv_cache_bytes
    need = max(case_cache_bytes(c) for c in CASE_TABLE if _group(c) == group)
    need = max(need, m.max_num_seqs * mamba_state_bytes(group.model)) * KV_HEADROOM
    return min(math.ceil(need / GiB) * GiB, KV_CACHE_CAP_BYTES)


def engine_kwargs(name: str, model_dir: str | Path, backend: str, tp: int, kv_cache_dtype: str = "auto",
                  online: bool = False, prefix_caching: bool = False) -> dict:
    """The engine's settings, as LLM(...)'s keyword arguments (the server's flags are made from these): CUDA graphs
    on, no prefix caching (but for the prefix cases' engines), a fixed KV cache; full-size models with dummy
    weights and token-id prompts."""
    m = MODELS[name]
    backend, _, cudagraph_mode = backend.partition("+")
    kwargs = dict(model=str(model_dir), attention_backend=backend, tensor_parallel_size=tp, seed=0,
                  max_model_len=m.max_model_len, max_num_seqs=m.max_num_seqs, gpu_memory_utilization=0.15,
                  kv_cache_memory_bytes=kv_cache_bytes(Group(name, kv_cache_dtype, online, prefix_caching)),
                  enable_prefix_caching=prefix_caching, enforce_eager=False)
    if not m.tiny:
        # vLLM's pooling runner will not start with skip_tokenizer_init: the embedding model has a tokenizer.
        kwargs.update(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=not m.pooling)
    if m.pooling:
        kwargs.update(runner="pooling", max_num_batched_tokens=EMBED_BATCH_TOKENS, enable_chunked_prefill=False)
    if kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    if cudagraph_mode:
        kwargs["compilation_config"] = {"cudagraph_mode": cudagraph_mode}
    return kwargs


def server_command(name: str, model_dir: str | Path, backend: str, tp: int, port: int,
                   kv_cache_dtype: str = "auto") -> list[str]:
    """`vllm serve` of the model on 127.0.0.1:port with engine_kwargs' settings, served as `name`."""
    kwargs = engine_kwargs(name, model_dir, backend, tp, kv_cache_dtype, online=True)
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", kwargs.pop("model"), "--host",
               "127.0.0.1", "--port", str(port), "--served-model-name", name]
    for key, value in kwargs.items():
        flag = key.replace("_", "-")
        value = json.dumps(value) if isinstance(value, dict) else value
        command += [f"--{flag}"] if value is True else [f"--no-{flag}"] if value is False else [f"--{flag}", str(value)]
    return command


def build_model(name: str = PRESET) -> Path:
    """The model's directory (built once, then reused)."""
    sys.path.insert(0, str(REPO / "examples"))
    m = MODELS[name]
    if m.tiny:
        from build_tiny_model import build

        positions = max(DEFAULT_POSITIONS, MAX_MODEL_LEN)
        folder = f"tk_serve_{m.preset}" + (f"_pos{positions}" if positions != DEFAULT_POSITIONS else "")
        return build(Path(tempfile.gettempdir()) / folder, preset=m.preset, max_position_embeddings=positions)
    from build_model_configs import build

    overrides = {"max_position_embeddings": m.positions} if m.positions else {}
    return build(Path(tempfile.gettempdir()) / f"tk_serve_{name}", m.preset, tokenizer=m.pooling, **overrides)


def prompt_vocab(name: str, model_dir: str | Path) -> int:
    """Token ids the prompts draw from: the tokenizer's where the engine has one, else the model's vocabulary."""
    m = MODELS[name]
    if m.tiny or m.pooling:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(str(model_dir)))
        return size if m.tiny else min(size, json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def _lengths(count: int, length: int | tuple[int, int], rng: random.Random) -> list[int]:
    return [length] * count if isinstance(length, int) else [rng.randint(*length) for _ in range(count)]


def _prompts(count: int, length: int | tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """Random token ids (clear of the first 16, special tokens); a range of lengths is drawn first, so the
    lengths do not depend on the vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(n)] for n in _lengths(count, length, rng)]


def case_prompts(case: Case, vocab: int) -> list[list[int]]:
    """The case's prompts: _prompts' (seed PROMPT_SEED), each after the case's shared prefix where it has one
    (the prefix drawn from PROMPT_SEED, the rest then from PROMPT_SEED + 1)."""
    if not case.shared_prefix:
        return _prompts(case.prompts, case.prompt_len, vocab, seed=PROMPT_SEED)
    prefix = _prompts(1, case.shared_prefix, vocab, seed=PROMPT_SEED)[0]
    return [prefix + p for p in _prompts(case.prompts, case.prompt_len, vocab, seed=PROMPT_SEED + 1)]


def engine(model: str, backend: str, tp: int, *, serve_model: str = PRESET, kv_cache_dtype: str = "auto",
           prefix_caching: bool = False, **extra):
    """An LLM with the bench's settings (engine_kwargs), and the vocabulary its prompts draw from."""
    from vllm import LLM

    llm = LLM(**engine_kwargs(serve_model, model, backend, tp, kv_cache_dtype, prefix_caching=prefix_caching),
              **extra)
    return llm, prompt_vocab(serve_model, model)


def engine_env(env: dict[str, str], model: str, impl: str) -> dict[str, str]:
    """The impl's worker environment: for a Mamba-2 model, tk gets what a TK user gets (TK_MAMBA unset: TK's scan,
    vLLM's decode update, following the attention backend), flash_attn vLLM's SSD (TK_MAMBA=0), whatever the
    caller exported; and vLLM's collective_rpc allowed to ship tk_stats' reader (a function) to the worker."""
    if not MODELS[model].mamba:
        return env
    out = {k: v for k, v in env.items() if k != "TK_MAMBA"}
    if impl != "tk":
        out["TK_MAMBA"] = "0"
    return {**out, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _read_tk_stats(worker) -> dict:
    """Runs in the engine's worker process (collective_rpc passes the worker): TK's Mamba counters there."""
    try:
        from tk_backend.vllm import mamba
    except ImportError:
        return {}
    return dict(mamba.STATS)


def tk_stats(llm) -> dict:
    """tk_backend.vllm.mamba.STATS summed over the engine's workers, since the engine started (profile run and
    graph capture included). They count the Python calls: a decode step replayed from a CUDA graph adds none."""
    total: dict[str, int] = {}
    for stats in llm.collective_rpc(_read_tk_stats):
        for key, count in (stats or {}).items():
            total[key] = total.get(key, 0) + count
    return dict(sorted(total.items()))


def case_inputs(case: str, vocab: int):
    """An offline case's prompts (the same random tokens for every backend) and sampling parameters (None: embed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    c = ALL_CASES[case]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case_prompts(c, vocab)]
    if c.kind == "embed":
        return prompts, None
    return prompts, SamplingParams(max_tokens=c.new_tokens, ignore_eos=True, temperature=0.0)


# --------------------------------------------------------------------------------------------------- worker


def _replier(replies: str):
    def reply(message: dict) -> None:
        with open(replies, "a") as f:
            f.write(json.dumps(message) + "\n")

    return reply


def worker(model: str, backend: str, tp: int, replies: str, serve_model: str = PRESET,
           kv_cache_dtype: str = "auto", prefix_caching: bool = False) -> None:
    """Starts the engine, warms it up, then serves the coordinator's commands from stdin, one a line: a case
    name (one timed run of it; the reply is a JSON line appended to `replies`) or `quit`. The first reply,
    {"ready": true}, says the engine is up."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    pooling = MODELS[serve_model].pooling
    llm, vocab = engine(model, backend, tp, serve_model=serve_model, kv_cache_dtype=kv_cache_dtype,
                        prefix_caching=prefix_caching)
    warm = [TokensPrompt(prompt_token_ids=p) for p in _prompts(16, 64, vocab, seed=1)]
    if pooling:
        llm.embed(warm, use_tqdm=False)
    else:
        llm.generate(warm, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0), use_tqdm=False)
    inputs = {}
    reply = _replier(replies)
    reply({"ready": True})
    for line in sys.stdin:
        case = line.strip()
        if case == "quit":
            break
        if case not in inputs:
            inputs[case] = case_inputs(case, vocab)
            if ALL_CASES[case].shared_prefix:  # the prefix cached before the first timed run, as after it
                llm.generate(inputs[case][0][:1], SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
                             use_tqdm=False)
        prompts, params = inputs[case]
        start = time.perf_counter()
        if params is None:
            outputs = llm.embed(prompts, use_tqdm=False)
            seconds = time.perf_counter() - start
            reply({"case": case, "seconds": seconds, "tokens": sum(len(o.prompt_token_ids) for o in outputs),
                   "requests": sum(1 for o in outputs if len(o.outputs.embedding))})
            continue
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = {"tk_stats": tk_stats(llm)} if MODELS[serve_model].mamba else {}
        reply({"case": case, "seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
               **stats})


def stream_completion(host: str, port: int, payload: dict, timeout: float = RUN_TIMEOUT_S) -> dict:
    """One streamed /v1/completions request: its TTFT (to the first chunk with choices), latency (to the last such
    chunk) and output tokens (the usage chunk), as vllm bench serve's client measures them; or its error."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {response.read()[:300]!r}"}
        ttft, last, tokens = None, start, None
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                last = time.perf_counter()
                ttft = last - start if ttft is None else ttft
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        if ttft is None or tokens is None:
            return {"error": "the stream ended without a token or without its usage"}
        return {"ttft": ttft, "latency": last - start, "tokens": tokens}
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process at `rate` a second (0: all at once)."""
    rng, t, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    return offsets


def online_load(host: str, port: int, served: str, prompts: list[list[int]], new_tokens: int, rate: float,
                seed: int = PROMPT_SEED) -> dict:
    """Send every prompt as a streamed completion at its arrival time (concurrently, unbounded); the run's seconds,
    output tokens, failures and TTFT / TPOT percentiles (ms, as vllm bench serve's: numpy's linear interpolation)."""
    import numpy as np

    offsets = arrival_offsets(len(prompts), rate, seed)
    start = time.perf_counter()

    def send(i: int) -> dict:
        time.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        return stream_completion(host, port, {"model": served, "prompt": prompts[i], "max_tokens": new_tokens,
                                              "ignore_eos": True, "temperature": 0.0, "stream": True,
                                              "stream_options": {"include_usage": True}})

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(send, range(len(prompts))))
    seconds = time.perf_counter() - start
    done = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttfts = [r["ttft"] * 1e3 for r in done]
    tpots = [(r["latency"] - r["ttft"]) * 1e3 / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    summary = {"seconds": seconds, "tokens": sum(r["tokens"] for r in done), "failed": len(errors)}
    for metric, values in (("ttft", ttfts), ("tpot", tpots)):
        for p in (50, 99):
            summary[f"{metric}_p{p}_ms"] = float(np.percentile(values, p)) if values else None
    if errors:
        summary["first_error"] = errors[0]
    return summary


def online_worker(model: str, backend: str, tp: int, replies: str, serve_model: str,
                  kv_cache_dtype: str = "auto") -> None:
    """worker()'s protocol over vLLM's OpenAI server: starts `vllm serve` (in this process group, so a killed bench
    takes it along: serve_demo.start_server's own session would outlive it), warms it up, then runs each case's
    load (online_load) on command; stops the server however it ends."""
    sys.path.insert(0, str(REPO / "scripts"))
    from serve_demo import free_port, log_tail, vllm_env, wait_ready

    port = free_port()
    log_path = Path(replies).with_suffix(".server.log")
    command = server_command(serve_model, model, backend, tp, port, kv_cache_dtype)
    print("serve: " + " ".join(command), flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), cwd=REPO)
    try:
        wait_ready(f"http://127.0.0.1:{port}", server, STARTUP_TIMEOUT_S - 60)
        vocab = prompt_vocab(serve_model, model)
        warm = online_load("127.0.0.1", port, serve_model, _prompts(16, 64, vocab, seed=1), 32, rate=0.0)
        if warm["failed"]:
            raise RuntimeError(f"warm-up: {warm['failed']} of 16 requests failed: {warm['first_error']}")
        reply = _replier(replies)
        reply({"ready": True})
        prompts = {}
        for line in sys.stdin:
            case = line.strip()
            if case == "quit":
                break
            c = ALL_CASES[case]
            prompts.setdefault(case, case_prompts(c, vocab))
            reply({"case": case, **online_load("127.0.0.1", port, serve_model, prompts[case], c.new_tokens, c.rate)})
    except BaseException:
        print(f"serve: the server's log (tail):\n{log_tail(log_path)}", flush=True)
        raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


# ---------------------------------------------------------------------------------------------- coordinator


class Engine:
    """The coordinator's handle on one worker process: commands go to its stdin, replies come back as lines of
    a file (its own stdout and stderr go to a log file: vLLM logs to stdout)."""

    def __init__(self, impl: str, command: list[str], env: dict[str, str], workdir: Path):
        self.impl = impl
        self.replies = workdir / f"{impl}.replies"
        self.log = workdir / f"{impl}.log"
        self.seen = 0
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*command, "--replies", str(self.replies)], cwd=REPO, env=env,
                                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict:
        """The next reply; raises RuntimeError if the worker exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = self.replies.read_text().splitlines() if self.replies.exists() else []
            if len(lines) > self.seen and lines[self.seen].endswith("}"):
                self.seen += 1
                return json.loads(lines[self.seen - 1])
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.impl}: the worker exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.impl}: no reply in {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.01)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _seconds_and_tokens(reply: dict) -> tuple[float, int]:
    return reply["seconds"], reply["tokens"]


def interleaved_runs(engines: list[Engine], cases: list[str], repeats: int, record=_seconds_and_tokens,
                     failures: list[str] | None = None) -> dict[str, dict[str, list]]:
    """runs[impl][case] = [record(reply), ...] (default: (seconds, tokens)): every engine up (one that fails is
    left out with a message, also appended to `failures`), then `repeats` rounds, each case once per engine, one
    at a time, the engines' order rotated each round."""
    def failed(message: str) -> None:
        print(f"serve: {message}", flush=True)
        if failures is not None:
            failures.append(message)

    live = []
    for e in engines:
        try:
            e.receive(STARTUP_TIMEOUT_S)
            live.append(e)
        except RuntimeError as exc:
            failed(str(exc))
            e.close()
    runs = {e.impl: {case: [] for case in cases} for e in live}
    for r in range(repeats):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for case in cases:
            for e in order:
                if e not in live:
                    continue
                try:
                    e.send(case)
                    got = e.receive(RUN_TIMEOUT_S)
                except (RuntimeError, OSError) as exc:
                    failed(f"{e.impl} failed in round {r}: {exc}")
                    live.remove(e)
                    e.close()
                    runs.pop(e.impl, None)
                    continue
                runs[e.impl][case].append(record(got))
    return runs


def case_row(case: Case, impl: str, replies: list[dict], suffix: str = "", kv_bytes: int | None = None):
    """The impl's row of the case from its runs' replies (None, with a message, when a run fell short of the
    case's tokens or requests)."""
    from benchlib import Row

    short = [r for r in replies if r["tokens"] != case.expected_tokens or r.get("failed")
             or r.get("requests", case.prompts) != case.prompts]
    if short or not replies:
        detail = "; ".join(f"{r['tokens']} tokens, {r.get('failed', 0)} failed {r.get('first_error', '')}"
                           for r in short) or "no runs"
        print(f"serve: {impl} {case.name}: runs fell short of {case.expected_tokens} tokens: {detail}", flush=True)
        return None
    seconds = statistics.median(r["seconds"] for r in replies)
    extra = {"kv_cache_gib": round(kv_bytes / GiB, 2)} if kv_bytes is not None else {}
    name = case.name + suffix
    if case.online:
        metrics = {k: round(statistics.median(r[k] for r in replies), 3)
                   for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}
        runs = [{"seconds": round(r["seconds"], 3), **{k: round(r[k], 3) for k in metrics}} for r in replies]
        return Row("serve", name, impl, metrics["tpot_p50_ms"], note="median_ms: TPOT p50",
                   extra={**metrics, "requests": case.prompts, "request_rate": case.rate,
                          "tokens": case.expected_tokens, "runs": runs, **extra})
    runs_s = [round(r["seconds"], 3) for r in replies]
    if case.kind == "embed":
        return Row("serve", name, impl, seconds * 1e3, extra={
            "req_s": round(case.prompts / seconds, 1), "requests": case.prompts, "prompt_tokens": case.expected_tokens,
            "runs_s": runs_s, **extra})
    if "tk_stats" in replies[-1]:  # the worker's TK Mamba counters after its last run
        extra["tk_stats"] = replies[-1]["tk_stats"]
    return Row("serve", name, impl, seconds * 1e3,
               extra={"tok_s": round(case.expected_tokens / seconds, 1), "tokens": case.expected_tokens,
                      "runs_s": runs_s, **extra})


def worker_command(group: Group, model_dir: Path, backend: str, tp: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(model_dir), "--backend", backend,
            "--tp", str(tp), "--serve-model", group.model, "--kv-cache-dtype", group.kv_cache_dtype,
            *(["--online"] if group.online else []), *(["--prefix-caching"] if group.prefix_caching else [])]


def run(quick: bool = False) -> list:
    from benchlib import print_table
    from serve_demo import vllm_env

    models = selected_models()
    groups = plan(selected_cases(models, quick))
    impls = {m: selected_impls(m) for m in models}
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"serve: skipped (vLLM is not importable: {exc}; GPU host: source /tmp/vllm_site/env.sh)", flush=True)
        return []
    tp = int(os.environ.get("TK_SERVE_TP", "1"))
    env = vllm_env()
    rows, failures = [], []
    # $TK_SERVE_LOG_DIR keeps the engines' logs (and replies) there, e.g. under a device call's $OUT: a run killed
    # by a call's time limit otherwise leaves nothing saying where it stood (findings/serving.md#serve-mamba-first-try)
    keep = os.environ.get("TK_SERVE_LOG_DIR")
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory()) as tmp:
        for group, cases in groups:
            model = MODELS[group.model]
            suffix = (f"_tp{tp}" if tp > 1 else "") + (
                f"_len{MAX_MODEL_LEN}" if model.tiny and MAX_MODEL_LEN != 2048 else "")
            kv_bytes = kv_cache_bytes(group)
            print(f"serve: {group.label}: {', '.join(c.name for c in cases)}; impls {', '.join(impls[group.model])}, "
                  f"{rounds(group.model)} rounds, {kv_bytes / GiB:g} GiB of KV cache each", flush=True)
            model_dir = build_model(group.model)
            workdir = Path(tmp) / group.label
            workdir.mkdir(parents=True, exist_ok=bool(keep))
            engines = [Engine(impl, worker_command(group, model_dir, IMPLS[impl], tp),
                              engine_env(env, group.model, impl), workdir) for impl in impls[group.model]]
            try:
                runs = interleaved_runs(engines, [c.name for c in cases], rounds(group.model), record=dict,
                                        failures=failures)
            finally:
                for e in engines:
                    e.close()
            group_rows = []
            for impl, per_case in runs.items():
                for case in cases:
                    row = case_row(case, impl, per_case[case.name], suffix, None if model.tiny else kv_bytes)
                    if row is not None:
                        group_rows.append(row)
            rows += group_rows
            # Each group's rows as soon as they exist: a run a device call's limit cuts short still shows the groups
            # it finished (bench.py writes the results file only at the end).
            print(f"serve: {group.label} done", flush=True)
            print_table(group_rows)
            sys.stdout.flush()
    if failures:
        print("serve: engines that failed (left out of the rows above):\n  " + "\n  ".join(
            f.splitlines()[0] for f in failures), flush=True)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--replies", required=True)
    parser.add_argument("--serve-model", default=PRESET, choices=list(MODELS))
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--online", action="store_true", help="serve through vLLM's OpenAI server")
    parser.add_argument("--prefix-caching", action="store_true", help="the engine caches prefixes")
    args = parser.parse_args()
    if args.online:
        online_worker(args.model, args.backend, args.tp, args.replies, args.serve_model, args.kv_cache_dtype)
    else:
        worker(args.model, args.backend, args.tp, args.replies, args.serve_model, args.kv_cache_dtype,
               args.prefix_caching)
