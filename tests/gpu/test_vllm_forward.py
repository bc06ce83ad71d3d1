"""The vLLM backend's forward pass on the GPU with the real kernels, without an engine: the serving simulation of
tests/vllm_sim.py (vLLM's KV cache allocation and metadata, the TK builder, vLLM's reshape_and_cache_flash)
driven through prefill, chunked prefill over a cached prefix, decode, speculative verification, CUDA-graph
padding and mixed batches, each step checked against dense float32 reference attention. Seconds, where the
engine tests take minutes: the first place a backend change (e.g. how a mixed batch is split between the decode
and prefill ops) shows a wrong row. Needs vLLM importable (GPU host: source /tmp/vllm_site/env.sh).
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm", reason="vLLM is not importable (GPU host: source /tmp/vllm_site/env.sh)")

from tests.vllm_sim import ServingSimulation  # noqa: E402


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
