"""The vLLM backend's forward pass on the GPU with the real kernels, without an engine: the serving simulation of
tests/vllm_sim.py (vLLM's KV cache allocation and metadata, the TK builder, vLLM's reshape_and_cache_flash)
driven through prefill, chunked prefill over a cached prefix, decode, speculative verification, CUDA-graph
padding and mixed batches, each step checked against dense float32 reference attention. Seconds, where the
engine tests take minutes: the first place a backend change (e.g. how a mixed batch is split between the decode
and prefill ops) shows a wrong row. Needs vLLM importable (GPU host: source /tmp/vllm_site/env.sh).

Our counterparts of vLLM's tests/v1/attention/test_attention_backends.py: causal and sliding-window decoders (the
first two tests), attention sinks at gpt-oss's shape, head size 96 (Phi-3), bidirectional decoder steps, and
encoder-only batches (the last four groups).
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm", reason="vLLM is not importable (GPU host: source /tmp/vllm_site/env.sh)")

from tests.vllm_sim import ServingSimulation, encoder_only_batch  # noqa: E402


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 2, 64), (4, 4, 128), (8, 1, 256), (32, 8, 128)])
def test_forward_serves_a_run_of_steps(layout, num_heads, num_kv_heads, head_size):
    sim = ServingSimulation(num_heads, num_kv_heads, head_size, prompt_lens=[37, 5, 70], layout=layout,
                            device="cuda")
    sim.prefill_cached_prefix(2, 40)  # request 2's first 40 tokens come from the prefix cache
    sim.step({0: 37, 1: 5, 2: 30})  # prefill, short prefill, chunked prefill over the cached prefix
    sim.step({0: 1, 1: 1, 2: 1})  # decode
    sim.step({0: 4, 1: 4, 2: 4})  # speculative verification: 1 + 3 drafts per request
    sim.step({0: 1, 1: 9})  # mixed decode + prefill
    sim.step({0: 1, 1: 1, 2: 1}, pad_requests=2, pad_tokens=2)  # decode padded for a CUDA graph of 5


@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (24, 5.0)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 2, 64), (32, 8, 128), (16, 1, 128)])
def test_forward_serves_mixed_batches_of_many_decodes(num_heads, num_kv_heads, head_size, sliding_window, softcap):
    """Mixed steps as vLLM forms them in a prefill-heavy run: many one-token requests first (vLLM reorders them
    there for a backend that asks), then prompt chunks, then decodes again; also the other orders."""
    n = 12
    sim = ServingSimulation(num_heads, num_kv_heads, head_size, prompt_lens=[40] * n + [150, 90], max_len=320,
                            sliding_window=sliding_window, softcap=softcap, device="cuda")
    sim.step({r: 17 + r for r in range(n)})  # prompts
    decodes = {r: 1 for r in range(n)}
    sim.step({**decodes, n: 33})  # n decodes, then a prompt chunk
    sim.step({**decodes, n: 20, n + 1: 90})  # decodes, a second chunk, a whole prompt
    sim.step({n: 5, **decodes})  # a prompt chunk first
    sim.step({0: 1, 1: 1, n + 1: 7})  # few decodes
    sim.step({**decodes, n: 1, n + 1: 1})  # all decode again: the uniform path


def _serve_every_kind_of_step(sim: ServingSimulation, n: int, long: int) -> None:
    """n requests of ~40 tokens, then requests n and n + 1 of `long` tokens: prompts, a chunk over a cached prefix,
    decode, verification, mixed batches (split and not), CUDA-graph padding."""
    sim.prefill_cached_prefix(n, long // 2)
    sim.step({r: 30 + r for r in range(n)} | {n: long // 2})  # prompts, a chunk over a cached prefix
    sim.step({r: 1 for r in range(n)} | {n: 1})  # decode
    sim.step({r: 4 for r in range(n)} | {n: 4})  # verification: 1 + 3 drafts
    sim.step({r: 1 for r in range(n)} | {n: 20, n + 1: long})  # mixed: the leading decodes split off
    sim.step({n + 1: 3, **{r: 1 for r in range(3)}})  # a prompt chunk first: all through the prefill op
    sim.step({r: 1 for r in range(n)} | {n: 1, n + 1: 1}, pad_requests=3, pad_tokens=3)  # graph padding


@pytest.mark.parametrize("sliding_window", [128, None])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(64, 8), (8, 8)])
def test_forward_applies_attention_sinks(num_heads, num_kv_heads, sliding_window):
    """gpt-oss-20b's attention: head size 64, 64 q / 8 kv heads, a 128-token window on every other layer, sinks
    (vLLM's bf16 parameter, float32 to the kernels); contexts well past the window."""
    n = 10
    sim = ServingSimulation(num_heads, num_kv_heads, 64, prompt_lens=[300] * n + [400, 400], max_len=480,
                            sliding_window=sliding_window, sinks=True, device="cuda")
    _serve_every_kind_of_step(sim, n, long=300)


@pytest.mark.parametrize("sinks_head_size", [128, 256])
def test_forward_applies_attention_sinks_at_the_other_tile_head_sizes(sinks_head_size):
    sim = ServingSimulation(16, 4, sinks_head_size, prompt_lens=[70] * 10 + [150, 150], max_len=240,
                            sliding_window=48, sinks=True, device="cuda")
    _serve_every_kind_of_step(sim, 10, long=100)


@pytest.mark.parametrize("sliding_window", [None, 48])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (32, 8)])
def test_forward_serves_head_size_96(num_heads, num_kv_heads, sliding_window):
    """Phi-3-mini's attention: 32 heads of 96 (run on the 128-wide kernel tile, the extra columns zero)."""
    sim = ServingSimulation(num_heads, num_kv_heads, 96, prompt_lens=[60] * 10 + [200, 200], max_len=320,
                            sliding_window=sliding_window, device="cuda")
    _serve_every_kind_of_step(sim, 10, long=150)


@pytest.mark.parametrize("sliding_window,sinks", [(None, False), (24, False), (128, True)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 2, 64), (32, 8, 128), (16, 16, 96)])
def test_forward_serves_a_bidirectional_decoder(num_heads, num_kv_heads, head_size, sliding_window, sinks):
    """Non-causal decoder steps (vLLM's use_non_causal, e.g. DFlash drafters): every query sees its request's keys
    on both sides, within a symmetric window."""
    if sinks and head_size not in (64, 128, 256):
        pytest.skip("attention sinks need head size 64, 128 or 256")
    sim = ServingSimulation(num_heads, num_kv_heads, head_size, prompt_lens=[60] * 10 + [200, 200], max_len=320,
                            sliding_window=sliding_window, sinks=sinks, causal=False, device="cuda")
    _serve_every_kind_of_step(sim, 10, long=150)


@pytest.mark.parametrize(
    "prompt_lens",
    # vLLM's small and medium encoder batches, ragged ones, one-token prompts (a batch that looks like a decode)
    [[32, 64, 128, 256], [256, 512, 1024, 2048], [1, 7, 300, 1, 65], [1, 1, 1, 1]],
)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,sliding_window,sinks",
    [(12, 12, 64, None, False),  # BERT-base / bge-base
     (12, 12, 64, None, True), (8, 2, 128, 64, False),  # EmbeddingGemma-like: a bidirectional window
     (16, 16, 96, None, False), (4, 1, 256, 100, False)],
)
def test_forward_serves_encoder_only_batches(num_heads, num_kv_heads, head_size, sliding_window, sinks, prompt_lens):
    """Encoder-only layers through vLLM's own EncoderOnlyAttention wrapper: no KV cache, each prompt attends over
    its own keys bidirectionally; CUDA-graph padding rows and requests."""
    encoder_only_batch(num_heads, num_kv_heads, head_size, prompt_lens, sliding_window=sliding_window, sinks=sinks,
                       pad_requests=2, pad_tokens=5, device="cuda")
