"""Attention prefill family: tk vs cuDNN and FA2 (torch SDPA, backend pinned), FA3 (tokenspeed_fa3) if present, and
vLLM's FA3 build (vllm_fa3, called as its FLASH_ATTN backend calls it) where vLLM is importable.

$TK_BENCH_CASES (comma-separated substrings of case names) runs only the matching cases."""
from __future__ import annotations

import functools
import os
import random

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tk_backend
from benchlib import Row, selected, time_per_call

TOKENS = 65536
DENSE = [(128, 16), (64, 32), (256, 8)]  # head dim, heads
# Models TK used to refuse: Phi-3-mini (32 heads of 96: _d96), and gpt-oss's layers (64 query / 8 kv heads of 64,
# attention sinks, alternating 128-token windows and full causal: _sink, _sink_win128).
PHI3 = (96, 32)
GPT_OSS = (64, 64, 8)  # head dim, q heads, kv heads


def wanted(case: str) -> bool:
    only = [c for c in os.environ.get("TK_BENCH_CASES", "").split(",") if c]
    return not only or any(c in case for c in only)


@functools.lru_cache(maxsize=None)
def _vllm_fa3():
    """vLLM's FA3 build's flash_attn_varlen_func, or None."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        return flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 (absent, or built for another torch)
        if "vllm" in str(exc) or not isinstance(exc, ImportError):
            print(f"  vllm_fa3 peer unavailable: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None


def _vllm_fa3_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window=-1, sinks=None, **paged):
    """A call of vLLM's FA3 build as FlashAttentionImpl makes it for prefill (flattened tokens, optional pages)."""
    varlen = _vllm_fa3()
    if varlen is None:
        return None
    out = torch.empty(q.shape, dtype=torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype, device=q.device)
    window_size = [window, 0] if window >= 0 else [-1, -1]
    return lambda i: varlen(q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k, cu_seqlens_k=cu_k,
                            causal=causal, window_size=window_size, out=out, fa_version=3, s_aux=sinks, **paged)


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
    impls = {k: v for k, v in impls.items() if v is not None}
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
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device="cuda")
    vllm_fa3 = _vllm_fa3_varlen(q.view(b * n, h, d), k.view(b * n, hkv, d), v.view(b * n, hkv, d), cu, cu, n, n,
                                causal)
    if vllm_fa3 is not None:
        impls["vllm_fa3"] = vllm_fa3
    return case, impls, flops


def _dense_case(b, n, h, d, causal, hkv=None, name=None) -> list[Row]:
    case = name or f"b{b}_h{h}_n{n}_d{d}_{'causal' if causal else 'full'}"
    return measure(*dense_impls(b, n, h, d, causal, hkv, name)) if wanted(case) else []


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
    impls["vllm_fa3"] = _vllm_fa3_varlen(q, k, v, cu, cu, max(lengths), max(lengths), True)
    return measure(case, impls, flops) if wanted(case) else []


def _paged_case(block: int, fp8: bool = False) -> list[Row]:
    """A 4096-token prompt chunk over a 28k-token paged context: pages of 16 tokens (vLLM's default), or 64; fp8:
    over an e4m3 cache (tk's bar: the TFLOP/s of the same case over a bf16 cache)."""
    new, ctx, hq, hkv, d = 4096, 28672, 32, 8, 128
    case = f"paged{block}_new4096_ctx28672_d128" + ("_fp8" if fp8 else "")
    if not wanted(case):
        return []
    blocks = ctx // block
    kv = torch.randn(blocks + 64, block, hkv, 2 * d, device="cuda", dtype=torch.bfloat16)
    if fp8:
        kv = kv.to(torch.float8_e4m3fn)
    k_cache, v_cache = kv[..., :d], kv[..., d:]
    table = torch.randperm(blocks + 64, device="cuda")[:blocks].to(torch.int32).view(1, blocks)
    q = torch.randn(new, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    used = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    flops = _flops([new], [ctx], hq, d, True)
    scales = {}
    if fp8:
        scales = {"k_descale": torch.ones(1, 1, device="cuda").expand(1, hkv),
                  "v_descale": torch.ones(1, 1, device="cuda").expand(1, hkv)}
    impls = {"tk": lambda i: tk_backend.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, new, ctx, causal=True,
                                                               block_table=table, seqused_k=used, out=out, **scales)}
    fa3 = _fa3()
    if fp8:  # vLLM's FA3 on an fp8 cache takes an fp8 query (FLASH_ATTN quantizes it per tensor first)
        q8 = q.to(torch.float8_e4m3fn)
        ones = torch.ones(1, 1, device="cuda").expand(1, hkv)
        impls["vllm_fa3"] = _vllm_fa3_varlen(q8, k_cache, v_cache, cu_q, None, new, ctx, True, seqused_k=used,
                                             block_table=table, q_descale=ones, k_descale=ones, v_descale=ones)
        return measure(case, impls, flops)
    if fa3 is not None:  # FA3 reads pages through flash_attn_with_kvcache (its varlen entry has no page table)
        q4 = q.view(1, new, hq, d)
        impls["fa3"] = lambda i: fa3.flash_attn_with_kvcache(q4, k_cache, v_cache, cache_seqlens=used, page_table=table,
                                                             causal=True)
    impls["vllm_fa3"] = _vllm_fa3_varlen(q, k_cache, v_cache, cu_q, None, new, ctx, True, seqused_k=used,
                                         block_table=table)
    return measure(case, impls, flops) if wanted(case) else []


def _windowed_flops(b, n, h, d, window) -> int:
    """Causal self-attention FLOPs with a left window (query i sees min(i, window) + 1 keys)."""
    visible = sum(min(i, window) + 1 for i in range(n)) if window >= 0 else n * (n + 1) // 2
    return 4 * b * h * d * visible


def _sink_case(b, n, window) -> list[Row]:
    """gpt-oss's attention: causal with sinks, full or in 128-token windows (the sliding layers)."""
    d, hq, hkv = GPT_OSS
    case = f"b{b}_hq{hq}_hkv{hkv}_n{n}_d{d}_sink" + (f"_win{window + 1}" if window >= 0 else "")
    if not wanted(case):
        return []
    q = torch.randn(b * n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sinks = torch.randn(hq, device="cuda", dtype=torch.float32)
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    impls = {"tk": lambda i: tk_backend.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True, out=out,
                                                               window_size=(window, 0), sinks=sinks)}
    impls["vllm_fa3"] = _vllm_fa3_varlen(q, k, v, cu, cu, n, n, True, window, sinks.to(torch.bfloat16))  # bf16 sinks
    return measure(case, impls, _windowed_flops(b, n, hq, d, window))


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
    if not quick:
        rows += _paged_case(16, fp8=True)
    if not quick:
        d, h = PHI3
        for n in (1024, 4096):
            for causal in (False, True):
                rows += _dense_case(TOKENS // n, n, h, d, causal)
        for n in (1024, 8192):
            for window in (-1, 127):
                rows += _sink_case(TOKENS // n, n, window)
                torch.cuda.empty_cache()
    return rows
