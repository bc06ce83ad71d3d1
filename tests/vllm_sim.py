"""A simulated vLLM serving run over one attention layer of the TK backend, shared by the CPU tests (the float32
references standing in for the kernels) and the GPU tests (the real kernels): vLLM's own KV cache allocation,
the CommonAttentionMetadata its model runner builds, the TK metadata builder, and the impl's forward, checked
against dense reference attention. Needs vLLM importable.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tk_backend import reference
from tk_backend.vllm import compat
from tk_backend.vllm.backend import TKAttentionBackend, TKAttentionImpl
from tk_backend.vllm.metadata import TKAttentionMetadataBuilder


def vllm_allocated_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, layout: str,
                         device: str | torch.device = "cpu"):
    """Two layers' KV caches as the installed vLLM allocates them, over one raw byte buffer."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.bfloat16)
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


def common_metadata(query_lens, seq_lens, block_table, slot_mapping, device="cpu") -> CommonAttentionMetadata:
    """What vLLM's model runner hands a metadata builder for one step: device tensors and the host copy."""
    qsl = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table.to(device), slot_mapping=slot_mapping.to(device),
    )


def builder(num_kv_heads=2, head_size=64, block_size=16, speculative_config=None,
            device="cpu") -> TKAttentionMetadataBuilder:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.bfloat16)
    config = SimpleNamespace(speculative_config=speculative_config)
    return TKAttentionMetadataBuilder(spec, ["layers.0.attn"], config, torch.device(device))


class ServingSimulation:
    """One attention layer over a paged cache, driven the way vLLM drives it, checked against dense attention.

    Each request has full random q/k/v histories; a step feeds each request its next `n` tokens (slot mapping
    through its shuffled pages), builds the metadata from a CommonAttentionMetadata, writes the cache, runs the
    impl, and compares every real output row with reference attention over the request's unpaged keys.
    On device "cuda" the impl runs the real kernels (the histories and the reference stay on the host).
    """

    def __init__(self, num_heads, num_kv_heads, head_size, prompt_lens, block_size=16, max_len=160,
                 sliding_window=None, softcap=None, layout="NHD", seed=0, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.h, self.hkv, self.d, self.bs = num_heads, num_kv_heads, head_size, block_size
        self.scale = head_size**-0.5
        self.max_blocks = math.ceil(max_len / block_size)
        num_blocks = len(prompt_lens) * self.max_blocks + 3
        self.device = torch.device(device)
        _, caches = vllm_allocated_cache(num_blocks, block_size, num_kv_heads, head_size, layout, self.device)
        self.kv_cache = caches[0]
        perm = torch.randperm(num_blocks - 1, generator=gen)[: len(prompt_lens) * self.max_blocks] + 1
        self.block_table = perm.view(len(prompt_lens), self.max_blocks).to(torch.int32)
        self.hist = [
            {n: torch.randn(max_len, hq, head_size, generator=gen).to(torch.bfloat16)
             for n, hq in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))}
            for _ in prompt_lens
        ]
        self.done = [0] * len(prompt_lens)
        # vLLM's sliding window w: a query sees itself and the w - 1 keys before it.
        self.window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        self.softcap = softcap or 0.0
        self.impl = TKAttentionImpl(num_heads, head_size, self.scale, num_kv_heads, None, sliding_window, "auto",
                                    softcap)
        self.builder = builder(num_kv_heads, head_size, block_size, device=self.device)
        self.layer = SimpleNamespace(_k_scale=torch.ones((), device=self.device),
                                     _v_scale=torch.ones((), device=self.device))

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
                    self.scale, True, self.window, self.softcap,
                )
                expected.append(out)
            self.done[r] = hi
        query_lens = [new_tokens[r] for r in reqs] + [0] * pad_requests
        seq_lens = [self.done[r] for r in reqs] + [0] * pad_requests
        block_table = torch.cat([self.block_table[reqs], torch.zeros(pad_requests, self.max_blocks,
                                                                      dtype=torch.int32)])
        cm = common_metadata(query_lens, seq_lens, block_table, torch.cat(slots), self.device)
        md = self.builder.build(0, cm)
        junk = {"q": self.h, "k": self.hkv, "v": self.hkv}
        q, k, v = (torch.cat([*rows, torch.randn(pad_tokens, junk[n], self.d).to(torch.bfloat16)])
                   .to(self.device) for n, rows in (("q", qs), ("k", ks), ("v", vs)))
        output = torch.full((q.shape[0], self.h, self.d), float("nan"), dtype=torch.bfloat16, device=self.device)
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, cm.slot_mapping)
        self.impl.forward(self.layer, q, k, v, self.kv_cache, md, output)
        if check:
            n = cm.num_actual_tokens
            got, want = output[:n].float().cpu(), torch.cat(expected)
            assert not torch.isnan(got).any(), "unwritten output rows"
            err = (got - want).norm() / want.norm()
            assert err < 1e-2, f"relative error {err:.3e}"
        return md
