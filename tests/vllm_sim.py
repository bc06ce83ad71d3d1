"""A simulated vLLM serving run over one attention layer of the TK backend, shared by the CPU tests (the float32
references standing in for the kernels) and the GPU tests (the real kernels): vLLM's own KV cache allocation,
the CommonAttentionMetadata its model runner builds, the TK metadata builder, and the impl's forward, checked
against dense reference attention. Decoder layers (causal or bidirectional, with sliding windows, soft-capping and
attention sinks) run through ServingSimulation; encoder-only layers (no KV cache) through encoder_only_batch, which
builds them the way vLLM's EncoderOnlyAttention does. Needs vLLM importable.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec, FullAttentionSpec

from tk_backend import reference
from tk_backend.vllm import compat
from tk_backend.vllm.backend import TKAttentionBackend, TKAttentionImpl
from tk_backend.vllm.metadata import TKAttentionMetadataBuilder


def vllm_allocated_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, layout: str,
                         device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
    """Two layers' KV caches as the installed vLLM allocates them, over one raw byte buffer (dtype: the cache's,
    torch.uint8 for --kv-cache-dtype fp8)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    page = spec.page_size_bytes
    raw = torch.zeros(2 * num_blocks * page, dtype=torch.int8, device=device)
    if compat.BACKEND_DECLARES_KV_SHAPE:  # vLLM 0.26: the backend's shape and stride order
        from vllm.v1.attention.backends import utils as attn_utils
        from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

        attn_utils.set_kv_cache_layout(layout)
        try:
            shape = TKAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
            order = TKAttentionBackend.get_kv_cache_stride_order()
        finally:
            attn_utils.set_kv_cache_layout(None)
        half = raw.numel() // 2
        caches = [_reshape_attention_kv_cache(raw[i * half:(i + 1) * half], spec, shape, order, num_blocks, None)
                  for i in range(2)]
    else:  # vLLM >= 0.27: one KVCacheLayout for the whole model
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        kv_layout = {"NHD": KVCacheLayout.LBNHC, "HND": KVCacheLayout.LBHNC}[layout]
        tensor = KVCacheTensor(size=raw.numel(), layers=["l0", "l1"], layer_stride=page * num_blocks,
                               block_stride=page)
        caches = create_kv_cache_views(raw, spec, num_blocks, kv_layout, tensor)
    return raw, caches


def common_metadata(query_lens, seq_lens, block_table, slot_mapping, device="cpu", causal=True,
                    num_tokens=None) -> CommonAttentionMetadata:
    """What vLLM's model runner hands a metadata builder for one step: device tensors and the host copy.
    num_tokens: the step's token count when padded past the requests' (vLLM's num_actual_tokens is the padded
    count)."""
    qsl = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]) if num_tokens is None else num_tokens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_table_tensor=block_table.to(device),
        slot_mapping=slot_mapping.to(device), causal=causal,
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
    )


def builder(num_kv_heads=2, head_size=64, block_size=16, speculative_config=None, device="cpu",
            spec_cls=FullAttentionSpec, builder_cls=TKAttentionMetadataBuilder,
            dtype=torch.bfloat16) -> TKAttentionMetadataBuilder:
    """dtype: the KV cache's (torch.uint8 for vLLM's --kv-cache-dtype fp8)."""
    spec = spec_cls(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    config = SimpleNamespace(speculative_config=speculative_config)
    return builder_cls(spec, ["layers.0.attn"], config, torch.device(device))


def random_sinks(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    """Attention sinks as vLLM's gpt-oss holds them: a parameter in the model's dtype, of gpt-oss's magnitude."""
    return (2 * torch.randn(num_heads, generator=gen)).to(torch.bfloat16)


def _layer(device: torch.device, k_scale: float = 1.0, v_scale: float = 1.0, q_scale: float = 1.0) -> SimpleNamespace:
    """An attention layer's KV-cache (and query) quantization scales, as vLLM keeps them."""
    def scale(x):
        return torch.tensor(x, dtype=torch.float32, device=device)

    return SimpleNamespace(_k_scale=scale(k_scale), _v_scale=scale(v_scale), _q_scale=scale(q_scale))


# --kv-cache-dtype fp8: the layer's scales, powers of two apart so that every descale's use shows
FP8_SCALES = {"k": 0.5, "v": 0.25, "q": 0.125}


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not torch.isnan(got).any(), "unwritten output rows"
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, f"relative error {err:.3e}"


class ServingSimulation:
    """One attention layer over a paged cache, driven the way vLLM drives it, checked against dense attention.

    Each request has full random q/k/v histories; a step feeds each request its next `n` tokens (slot mapping
    through its shuffled pages), builds the metadata from a CommonAttentionMetadata, writes the cache, runs the
    impl, and compares every real output row with reference attention over the request's unpaged keys.
    On device "cuda" the impl runs the real kernels (the histories and the reference stay on the host).

    sinks=True gives the layer random attention sinks (random_sinks); causal=False makes it a bidirectional decoder
    (every step's metadata says causal=False: a query sees its request's keys so far on both sides, within a
    symmetric window). kv_cache_dtype="fp8": an e4m3 cache written with the layer's FP8_SCALES, and the query
    quantized per tensor as vLLM does for backends that take it; the histories are e4m3 values times those scales,
    so quantizing them is exact and the reference stays the dense one.
    """

    def __init__(self, num_heads, num_kv_heads, head_size, prompt_lens, block_size=16, max_len=160,
                 sliding_window=None, softcap=None, layout="NHD", seed=0, device="cpu", sinks=False, causal=True,
                 kv_cache_dtype="auto"):
        gen = torch.Generator().manual_seed(seed)
        self.h, self.hkv, self.d, self.bs = num_heads, num_kv_heads, head_size, block_size
        self.scale = head_size**-0.5
        self.max_blocks = math.ceil(max_len / block_size)
        num_blocks = len(prompt_lens) * self.max_blocks + 3
        self.device = torch.device(device)
        self.fp8 = kv_cache_dtype == "fp8"
        cache_dtype = torch.uint8 if self.fp8 else torch.bfloat16
        _, caches = vllm_allocated_cache(num_blocks, block_size, num_kv_heads, head_size, layout, self.device,
                                         cache_dtype)
        self.kv_cache = caches[0]
        perm = torch.randperm(num_blocks - 1, generator=gen)[: len(prompt_lens) * self.max_blocks] + 1
        self.block_table = perm.view(len(prompt_lens), self.max_blocks).to(torch.int32)
        def history(name, heads):
            x = torch.randn(max_len, heads, head_size, generator=gen)
            if self.fp8:  # e4m3 values times the layer's scale: exact in bf16, and quantized exactly
                x = (2 * x).to(torch.float8_e4m3fn).float() * FP8_SCALES[name]
            return x.to(torch.bfloat16)

        self.hist = [{n: history(n, hq) for n, hq in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))}
                     for _ in prompt_lens]
        self.done = [0] * len(prompt_lens)
        # vLLM's sliding window w: a query sees itself and the w - 1 keys before it (and after it, bidirectional).
        self.causal = causal
        self.window = (-1, -1) if not sliding_window else (sliding_window - 1, 0 if causal else sliding_window - 1)
        self.softcap = softcap or 0.0
        self.sinks = random_sinks(num_heads, gen) if sinks else None
        self.impl = TKAttentionImpl(num_heads, head_size, self.scale, num_kv_heads, None, sliding_window,
                                    kv_cache_dtype, softcap,
                                    sinks=None if self.sinks is None else self.sinks.to(self.device))
        self.builder = builder(num_kv_heads, head_size, block_size, device=self.device, dtype=cache_dtype)
        self.layer = _layer(self.device, **({f"{n}_scale": x for n, x in FP8_SCALES.items()} if self.fp8 else {}))

    def prefill_cached_prefix(self, req: int, n: int) -> None:
        """Tokens whose K/V an earlier step (or another request, via prefix caching) already wrote."""
        self.step({req: n}, check=False)

    def step(self, new_tokens: dict[int, int], pad_requests: int = 0, pad_tokens: int = 0, check: bool = True):
        reqs = list(new_tokens)
        qs, ks, vs, slots, expected = [], [], [], [], []
        for r in reqs:
            lo, hi = self.done[r], self.done[r] + new_tokens[r]
            for name, dst in (("q", qs), ("k", ks), ("v", vs)):
                dst.append(self.hist[r][name][lo:hi])
            pos = torch.arange(lo, hi)
            slots.append(self.block_table[r].long()[pos // self.bs] * self.bs + pos % self.bs)
            if check:
                out, _ = reference.attention(
                    self.hist[r]["q"][lo:hi], self.hist[r]["k"][:hi], self.hist[r]["v"][:hi],
                    torch.tensor([0, hi - lo], dtype=torch.int32), torch.tensor([0, hi], dtype=torch.int32),
                    self.scale, self.causal, self.window, self.softcap, sinks=self.sinks,
                )
                expected.append(out)
            self.done[r] = hi
        query_lens = [new_tokens[r] for r in reqs] + [0] * pad_requests
        seq_lens = [self.done[r] for r in reqs] + [0] * pad_requests
        block_table = torch.cat([self.block_table[reqs], torch.zeros(pad_requests, self.max_blocks,
                                                                      dtype=torch.int32)])
        cm = common_metadata(query_lens, seq_lens, block_table, torch.cat(slots), self.device, causal=self.causal)
        md = self.builder.build(0, cm)
        junk = {"q": self.h, "k": self.hkv, "v": self.hkv}
        q, k, v = (torch.cat([*rows, torch.randn(pad_tokens, junk[n], self.d).to(torch.bfloat16)])
                   .to(self.device) for n, rows in (("q", qs), ("k", ks), ("v", vs)))
        output = torch.full((q.shape[0], self.h, self.d), float("nan"), dtype=torch.bfloat16, device=self.device)
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, cm.slot_mapping)
        if self.impl.supports_quant_query_input:  # vLLM's Attention layer quantizes it first
            q = (q.float() / self.layer._q_scale).to(torch.float8_e4m3fn)
        self.impl.forward(self.layer, q, k, v, self.kv_cache, md, output)
        if check:
            n = cm.num_actual_tokens
            _check(output[:n].float().cpu(), torch.cat(expected))
        return md


def encoder_only_batch(num_heads, num_kv_heads, head_size, prompt_lens, sliding_window=None, softcap=None,
                       sinks=False, pad_requests=0, pad_tokens=0, block_size=16, seed=0, device="cpu"):
    """One step of an encoder-only layer (BERT-like embedding models) as vLLM runs it, checked against dense
    bidirectional attention within each prompt: the TK backend wrapped by vLLM's own
    create_encoder_only_attention_backend (its builder subclass sets causal=False), the EncoderOnlyAttentionSpec
    group's metadata (a [num_reqs, 1] block table of zeros, a slot mapping of zeros), no KV cache, CUDA-graph padding
    (requests of 0 tokens, rows past the last request). Returns the metadata."""
    from vllm.model_executor.layers.attention.encoder_only_attention import create_encoder_only_attention_backend

    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    backend = create_encoder_only_attention_backend(TKAttentionBackend)
    step_builder = builder(num_kv_heads, head_size, block_size, device=device, spec_cls=EncoderOnlyAttentionSpec,
                           builder_cls=backend.get_builder_cls())
    layer_sinks = random_sinks(num_heads, gen) if sinks else None
    scale = head_size**-0.5
    impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, None, sliding_window, "auto", softcap,
                                  AttentionType.ENCODER_ONLY, None,
                                  sinks=None if layer_sinks is None else layer_sinks.to(device))
    total = sum(prompt_lens)
    q, k, v = (torch.randn(total + pad_tokens, heads, head_size, generator=gen).to(torch.bfloat16)
               for heads in (num_heads, num_kv_heads, num_kv_heads))
    query_lens = list(prompt_lens) + [0] * pad_requests
    cm = common_metadata(query_lens, query_lens, torch.zeros(len(query_lens), 1, dtype=torch.int32),
                         torch.zeros(total + pad_tokens, dtype=torch.int64), device, num_tokens=total + pad_tokens)
    md = step_builder.build(0, cm)
    no_cache = torch.tensor([], device=device)  # what an encoder-only layer's kv_cache is
    output = torch.full((total + pad_tokens, num_heads, head_size), float("nan"), dtype=torch.bfloat16,
                        device=device)
    q, k, v = q.to(device), k.to(device), v.to(device)
    impl.do_kv_cache_update(_layer(device), k, v, no_cache, cm.slot_mapping)
    impl.forward(_layer(device), q, k, v, no_cache, md, output)
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    cu = cm.query_start_loc_cpu[: len(prompt_lens) + 1]
    want, _ = reference.attention(q[:total].cpu(), k[:total].cpu(), v[:total].cpu(), cu, cu, scale, False, window,
                                  softcap or 0.0, sinks=layer_sinks)
    _check(output[:total].float().cpu(), want)
    return md
