"""Attention prefill family: tk vs cuDNN and FA2 (torch SDPA, backend pinned) and FA3 (tokenspeed_fa3) if present."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tk_backend
from benchlib import Row, selected, time_per_call

TOKENS = 65536
DENSE = [(128, 16), (64, 32), (256, 8)]  # head dim, heads


def _fa3():
    try:
        import flash_attn_interface  # tokenspeed_fa3 wheel
        return flash_attn_interface
    except ImportError:
        return None


def _flops(lengths_q, lengths_k, heads, d, causal):
    total = 0
    for lq, lk in zip(lengths_q, lengths_k):
        visible = sum(min(lk, lk - lq + i + 1) for i in range(lq)) if causal else lq * lk
        total += 4 * heads * d * visible
    return total


def measure(case: str, impls: dict, flops: int) -> list[Row]:
    """Time each impl; a peer that cannot run the case is left out, and the reason printed."""
    rows = []
    for impl, call in selected(impls).items():
        try:
            ms = time_per_call(call, 1)
        except Exception as exc:  # noqa: BLE001 - any failure of a peer
            print(f"  {case}: {impl} skipped ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
            continue
        rows.append(Row("attn_prefill", case, impl, ms, tflops=flops / ms / 1e9))
        print(f"  {case}: {impl} {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
    return rows


def dense_impls(b, n, h, d, causal, hkv=None, name=None) -> tuple[str, dict, int]:
    """A dense case's name, its impls (call(i) -> output) and its FLOP count, on one set of random inputs."""
    hkv = hkv or h
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    case = name or f"b{b}_h{h}_n{n}_d{d}_{'causal' if causal else 'full'}"
    flops = 4 * b * h * n * n * d // (2 if causal else 1)
    impls = {"tk": lambda i: tk_backend.flash_attn_func(q, k, v, causal=causal, out=out)}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for name_, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
        def call(i, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hkv != h)
        impls[name_] = call
    fa3 = _fa3()
    if fa3 is not None:
        impls["fa3"] = lambda i: fa3.flash_attn_func(q, k, v, causal=causal)
    return case, impls, flops


def _dense_case(b, n, h, d, causal, hkv=None, name=None) -> list[Row]:
    return measure(*dense_impls(b, n, h, d, causal, hkv, name))


def _varlen_case() -> list[Row]:
    rng = random.Random(0)
    lengths = [rng.randint(100, 8000) for _ in range(32)]
    h, d = 16, 128
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), h, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out = torch.empty_like(q)
    flops = _flops(lengths, lengths, h, d, True)
    case = "varlen32_100-8000_d128_causal"
    impls = {"tk": lambda i: tk_backend.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                               causal=True, out=out)}
    fa3 = _fa3()
    if fa3 is not None:
        impls["fa3"] = lambda i: fa3.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    return measure(case, impls, flops)


def _paged_case(block: int) -> list[Row]:
    """A 4096-token prompt chunk over a 28k-token paged context: pages of 16 tokens (vLLM's default), or 64."""
    new, ctx, hq, hkv, d = 4096, 28672, 32, 8, 128
    blocks = ctx // block
    kv = torch.randn(blocks + 64, block, hkv, 2 * d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = kv[..., :d], kv[..., d:]
    table = torch.randperm(blocks + 64, device="cuda")[:blocks].to(torch.int32).view(1, blocks)
    q = torch.randn(new, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    used = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    flops = _flops([new], [ctx], hq, d, True)
    case = f"paged{block}_new4096_ctx28672_d128"
    impls = {"tk": lambda i: tk_backend.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, new, ctx, causal=True,
                                                               block_table=table, seqused_k=used, out=out)}
    fa3 = _fa3()
    if fa3 is not None:  # FA3 reads pages through flash_attn_with_kvcache (its varlen entry has no page table)
        q4 = q.view(1, new, hq, d)
        impls["fa3"] = lambda i: fa3.flash_attn_with_kvcache(q4, k_cache, v_cache, cache_seqlens=used, page_table=table,
                                                             causal=True)
    return measure(case, impls, flops)


def run(quick: bool = False) -> list[Row]:
    rows = []
    for d, h in DENSE[:1] if quick else DENSE:
        for n in (4096,) if quick else (1024, 4096, 16384):
            for causal in (False, True):
                rows += _dense_case(TOKENS // n, n, h, d, causal)
                torch.cuda.empty_cache()
    rows += _dense_case(16, 4096, 32, 128, True, hkv=8, name="gqa32-8_b16_n4096_d128_causal")
    rows += _varlen_case()
    for block in (16,) if quick else (16, 64):
        rows += _paged_case(block)
    return rows
