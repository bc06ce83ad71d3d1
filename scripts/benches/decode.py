"""Paged decode family: tk vs FA3 flash_attn_with_kvcache (page_table) if present, and vLLM's FA3 build (vllm_fa3)
where vLLM is importable; else SDPA on gathered KV.

Every impl is timed by CUDA-graph replay (as vLLM runs decode); tbps counts the bytes of Q, the K and V
actually attended, and O. The tk row of a streaming case (B >= 8, 8k+ contexts, no window) also carries the case's
read ceiling (read_ceiling_tbps: its K / V tensors read by a read-only kernel, benches/read_ceiling.py) and
tk_of_read_ceiling, tk's TB/s over it (issue 48's bar: >= 0.97).
"""
from __future__ import annotations

import functools
import inspect
import os

import torch
import torch.nn.functional as F

import tk_backend
from tk_backend import attention, decode_plan
from benchlib import Row, impls_subset, selected, time_impls, time_per_call
from benches import read_ceiling

D = 128
# (batch, context, hq, hkv, page): vLLM's default 16-token pages, and a few cases with 64-token pages.
CASES = [(b, c, 32, 8, 16) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768)] + [(1, 131072, 32, 8, 16)]
CASES += [(b, c, 64, 8, 16) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768)]
CASES += [(1, 32768, 32, 8, 64), (8, 8192, 32, 8, 64), (64, 8192, 32, 8, 64)]
# Serving shapes: vLLM's block table is max_model_len wide whatever the contexts, so the plan is chosen for
# that width (here a 128k-token model) while the step's sequences are short. Case names end in _table{tokens}.
WIDE_TABLE = 131072
CASES += [(b, 1024, 32, 8, 16, WIDE_TABLE) for b in (1, 8, 64)]
# The serve bench's decode steps (scripts/benches/serve.py, prefill-heavy case: 256 sequences of 1024-token
# prompts generating 256 tokens, max_model_len 2048) at TP 1 (32 / 8 heads) and TP 2 (16 / 4 heads a rank):
# contexts spread over 1024-1280, pages laid out as vLLM's allocator hands them out (each prompt's pages in
# one run, then the generated tokens' pages interleaved across sequences), a 2048-token-wide table.
# Case names end in _servelayout; the TP 2 one runs again with its pages shuffled (what a long-running server's
# free list looks like; _servelens), which says whether the layout matters.
SERVE_CASES = [(256, 1152, 32, 8, 16), (256, 1152, 16, 4, 16)]
SERVE_TABLE = 2048
# And whole decode steps of the serve bench's 4-layer model (case names end in _4layers): each impl's layers
# in one timed call (tk: one schedule a step; vLLM's FA3: one scheduler metadata a step).
SERVE_LAYERS = 4
# A whole decode step of Llama-3.1-8B (32 layers) under its 128k-token table (case names end in _32layers): one plan
# (tk: one schedule) or one scheduler metadata (vLLM's FA3) a step, then every layer, as vLLM runs a captured step,
# so a schedule's cost counts once a step, as it does in serving, not once a layer.
WIDE_LAYERS = 32
# Models TK used to refuse (case names end in _d96, _sink, _win128): Phi-3-mini (32 heads of 96, no GQA) and gpt-oss
# (64 query / 8 kv heads of 64, attention sinks, alternating 128-token windows and full layers). Entries:
# (batch, context, hq, hkv, page, head dim, sinks, window).
MODEL_CASES = [(b, c, 32, 32, 16, 96, False, -1) for b in (8, 64) for c in (1024, 8192)]
MODEL_CASES += [(b, c, 64, 8, 16, 64, True, w) for b in (8, 64) for c in (1024, 8192) for w in (-1, 127)]
# Head dim 64 without sinks (Llama-3.2-1B: 32 / 8 heads of 64), beside gpt-oss's: is the D=64 kernel or the sinks slow?
MODEL_CASES += [(b, c, 32, 8, 16, 64, False, -1) for b in (8, 64) for c in (8192, 32768)]
# Head dim 256 (Gemma-2-9B: 16 / 8 heads of 256; its softcap and windows left out), whose plans are analytic.
MODEL_CASES += [(b, c, 16, 8, 16, 256, False, -1) for b, c in ((1, 8192), (1, 32768), (8, 1024), (8, 8192),
                                                               (8, 32768), (64, 1024), (64, 8192))]
# FP8 (e4m3) caches (case names end in _fp8): the main grid at 32 / 8 heads, and the 128k-token-table cases; tbps
# counts 1 byte a K / V element. vllm_fa3 reads them as vLLM's FLASH_ATTN does (its query quantized per tensor).
FP8_CASES = [(b, c, 32, 8, 16) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768)] + [(1, 131072, 32, 8, 16)]
FP8_CASES += [(b, 1024, 32, 8, 16, WIDE_TABLE) for b in (1, 8, 64)]


def wanted(case: str) -> bool:
    """$TK_BENCH_CASES (comma-separated substrings of case names) selects cases; unset: all."""
    only = [c for c in os.environ.get("TK_BENCH_CASES", "").split(",") if c]
    return not only or any(c in case for c in only)


def _fa3():
    try:
        import flash_attn_interface
        return flash_attn_interface
    except ImportError:
        return None


def _serve_layout(b: int, ctx: int, page: int, table_ctx: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(table, seqlens, blocks) of a serve-bench decode step: contexts ctx +- 128 (a fixed spread), each
    sequence's first 1024 tokens in consecutive pages, the pages after them dealt round-robin."""
    seqlens = [ctx - 128 + (i * 97) % 257 for i in range(b)]
    prompt_pages = 1024 // page
    pages = [(n + page - 1) // page for n in seqlens]
    table = [[i * prompt_pages + j for j in range(min(prompt_pages, n))] for i, n in enumerate(pages)]
    nxt = b * prompt_pages
    for j in range(prompt_pages, max(pages)):
        for i, n in enumerate(pages):
            if j < n:
                table[i].append(nxt)
                nxt += 1
    width = table_ctx // page
    rows = [r + [0] * (width - len(r)) for r in table]
    return (torch.tensor(rows, dtype=torch.int32, device="cuda"),
            torch.tensor(seqlens, dtype=torch.int32, device="cuda"), nxt)


@functools.lru_cache(maxsize=None)
def _vllm_fa3():
    """vLLM's FA3 build as its FLASH_ATTN backend calls it for decode: (flash_attn_varlen_func,
    get_scheduler_metadata), or None."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        return flash_attn_varlen_func, get_scheduler_metadata
    except Exception as exc:  # noqa: BLE001 (absent, or built for another torch)
        if "vllm" in str(exc) or not isinstance(exc, ImportError):
            print(f"  vllm_fa3 peer unavailable: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None


VLLM_FA3_SPLITS = 32  # vLLM's attention_config.flash_attn_max_num_splits_for_cuda_graph


def _vllm_fa3_call(vllm_fa, q, k_cache, v_cache, seqlens, table, out, layers=1, sinks=None, window=-1,
                   descales=None):
    """One decode step as vLLM's FLASH_ATTN backend runs it under full CUDA graphs: the scheduler metadata (its
    prepare kernel, once a step, part of the timed call here), then each layer's varlen kernel with one query
    token a sequence (sinks as its s_aux, a left window as its window_size)."""
    varlen, schedule = vllm_fa
    b, _, hq, d = q.shape
    window_size = (window, 0) if window >= 0 else (-1, -1)
    fp8 = descales is not None  # FLASH_ATTN quantizes the query per tensor for an fp8 cache (outside this call)
    if fp8:
        q = (q.float() / descales[0][0, 0]).to(torch.float8_e4m3fn)
        scales = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    else:
        scales = {}
    k_layers, v_layers = _per_layer(k_cache), _per_layer(v_cache)
    hkv, page = k_layers[0].shape[2], k_layers[0].shape[1]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    max_k = int(seqlens.max())
    q3, out3 = q.view(b, hq, d), out.view(b, hq, d)

    def call(i):
        metadata = schedule(batch_size=b, max_seqlen_q=1, max_seqlen_k=max_k, num_heads_q=hq, num_heads_kv=hkv,
                            headdim=d, cache_seqlens=seqlens, qkv_dtype=q.dtype, cu_seqlens_q=cu_q, page_size=page,
                            causal=True, window_size=window_size, num_splits=VLLM_FA3_SPLITS)
        for layer in range(layers):
            varlen(q3, k_layers[layer % len(k_layers)], v_layers[layer % len(v_layers)], max_seqlen_q=1,
                   cu_seqlens_q=cu_q, max_seqlen_k=max_k, seqused_k=seqlens,
                   softmax_scale=d ** -0.5, causal=True, window_size=list(window_size), block_table=table, out=out3,
                   scheduler_metadata=metadata, num_splits=VLLM_FA3_SPLITS, fa_version=3,
                   s_aux=None if sinks is None else sinks.to(torch.bfloat16), **scales)  # its sinks: bf16
    return call


def _per_layer(cache) -> list:
    """A case's caches as a list, one a layer or one for all (_layer_caches)."""
    return cache if isinstance(cache, list) else [cache]


def _layer_caches(cache: torch.Tensor, layers: int) -> torch.Tensor | list[torch.Tensor]:
    """A multi-layer case's caches: one a layer where a layer's would sit in L2 (50 MB on an H200) across the step
    (a real step reads every layer's from HBM), else the one cache for all layers."""
    if layers == 1 or cache.numel() * cache.element_size() * 2 > 128 * 2**20:
        return cache
    return [cache] + [torch.randn(cache.shape, device=cache.device).to(cache.dtype) for _ in range(layers - 1)]


def fp8_query_taken() -> bool:
    """Whether this tree's decode takes vLLM's e4m3 query (older trees: a 16-bit one, the unquantized query)."""
    return getattr(attention, "DECODE_TAKES_E4M3_QUERY", False)


def _tk_step(q, k_cache, v_cache, seqlens, table, out, layers, **descales):
    """A decode step of `layers` layers through tk: one plan a step (a fresh one each time the step is captured
    or run eagerly), so the first layer builds the work list and the rest reuse it, as vLLM's backend runs it.
    descales: an FP8 cache's q / k / v_descale. A tree without attention.PagedDecode passes its op's
    schedule_token, if it has one."""
    k_layers, v_layers = _per_layer(k_cache), _per_layer(v_cache)
    if not hasattr(attention, "PagedDecode"):
        reuse = "schedule_token" in inspect.signature(tk_backend.flash_attn_with_kvcache).parameters

        def call(i):
            extra = {"schedule_token": object()} if reuse else {}
            for layer in range(layers):
                tk_backend.flash_attn_with_kvcache(q, k_layers[layer % len(k_layers)], v_layers[layer % len(v_layers)],
                                                   seqlens, table, out=out, **extra, **descales)
        return call
    b, q_len, hq, d = q.shape
    first = k_layers[0]
    kv_dtype = {"kv_cache_dtype": first.dtype} if descales else {}

    def step(i):
        decode = attention.PagedDecode().plan(seqlens, table, num_q_heads=hq, num_kv_heads=first.shape[2],
                                              head_dim=d, page_size=first.shape[1], q_len=q_len, **kv_dtype)
        for layer in range(layers):
            decode.run(q, k_layers[layer % len(k_layers)], v_layers[layer % len(v_layers)], out, **descales)
    return step


def _case(b, ctx, hq, hkv, page, table_ctx=None, serve=False, shuffle=False, layers=1, d=D, sinks=False,
          window=-1, fp8=False) -> list[Row]:
    case = f"b{b}_ctx{ctx}_hq{hq}_hkv{hkv}_d{d}_page{page}" + (f"_table{table_ctx}" if table_ctx else "")
    case += ("_servelens" if shuffle else "_servelayout") if serve else ""
    case += f"_{layers}layers" if layers > 1 else ""
    case += ("_sink" if sinks else "") + (f"_win{window + 1}" if window >= 0 else "") + ("_fp8" if fp8 else "")
    if not wanted(case):
        return []
    if serve:
        table, seqlens, blocks = _serve_layout(b, ctx, page, table_ctx)
        tokens = int(seqlens.sum())
        if shuffle:
            table = torch.randperm(blocks, device="cuda").to(torch.int32)[table.long()]
    else:
        blocks, tokens = b * ctx // page, b * ctx
        table = torch.randperm(blocks, device="cuda").to(torch.int32).view(b, ctx // page)
        if table_ctx is not None:  # columns past the contexts (never read), as a max_model_len-wide table has
            table = torch.cat([table, table[:, :1].expand(b, (table_ctx - ctx) // page)], 1).contiguous()
        seqlens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    k_cache = torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    if fp8:  # e4m3 caches with per-tensor scales expanded to [batch, kv heads], as vLLM passes them
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sink_logits = torch.randn(hq, device="cuda", dtype=torch.float32) if sinks else None
    attended = tokens if window < 0 else b * min(ctx, window + 1)  # keys a windowed step reads
    kv_bytes = 1 if fp8 else 2  # (and the query's: e4m3 over an fp8 cache, as vLLM hands it to every backend)
    bytes_moved = (2 * kv_bytes * attended * hkv * d + (kv_bytes + 2) * b * hq * d) * layers
    num_sms, name = attention._device_info(q.device)
    plan = decode_plan.make_plan(b, table.shape[1] * page, 1, hq, hkv, d, page, num_sms, window, 0, name,
                                 **({"kv_dtype": decode_plan.kv_dtype_of(k_cache.dtype)} if fp8 else {}))
    step = int(decode_plan.step_chunk(plan, seqlens.cpu()))
    balanced = attention.balanced_mode(plan)
    schedule = "balanced shares" if balanced else f"this step's chunk {step} (coarsen_levels={plan.coarsen_levels})"
    print(f"  {case}: plan chunk_tokens={plan.chunk_tokens} max_splits={plan.max_splits} ctas={plan.num_ctas} "
          f"({plan.source}); {schedule}; K/V tile {decode_plan.kv_tile(plan, balanced)} keys", flush=True)
    extra = {}
    if sinks:
        extra["sinks"] = sink_logits
    if window >= 0:
        extra["window_size"] = (window, 0)
    descales = None
    tk_q = q
    if fp8:  # vLLM quantizes the query per tensor for an fp8 cache before any backend sees it (FLASH_ATTN, TK)
        descales = tuple(torch.full((1, 1), x, device="cuda").expand(b, hkv) for x in (0.05, 1.0, 1.0))
        extra["k_descale"], extra["v_descale"] = descales[1], descales[2]
        if fp8_query_taken():
            tk_q = (q.float() / descales[0][0, 0]).to(torch.float8_e4m3fn)
            extra["q_descale"] = descales[0]
    k_layers, v_layers = _layer_caches(k_cache, layers), _layer_caches(v_cache, layers)
    if layers == 1:
        impls = {"tk": lambda i: tk_backend.flash_attn_with_kvcache(tk_q, k_cache, v_cache, seqlens, table, out=out,
                                                                    **extra)}
    else:
        if sinks or window >= 0:
            raise ValueError("multi-layer cases take no sinks or window (the step's plan would need them)")
        impls = {"tk": _tk_step(tk_q, k_layers, v_layers, seqlens, table, out, layers,
                                **{k: v for k, v in extra.items() if k.endswith("_descale")})}
    fa3, vllm_fa = _fa3(), _vllm_fa3()
    if fa3 is not None and not sinks and not fp8:  # (the tokenspeed wheel: no sinks; fp8 not tried)
        fa3_window = {"window_size": (window, 0)} if window >= 0 else {}
        fa3_k, fa3_v = _per_layer(k_layers), _per_layer(v_layers)

        def fa3_step(i):
            for layer in range(layers):
                fa3.flash_attn_with_kvcache(q, fa3_k[layer % len(fa3_k)], fa3_v[layer % len(fa3_v)],
                                            cache_seqlens=seqlens, page_table=table, causal=True, **fa3_window)
        impls["fa3"] = fa3_step
    if vllm_fa is not None:  # the FA3 build vLLM's FLASH_ATTN backend calls (where vLLM is importable)
        impls["vllm_fa3"] = _vllm_fa3_call(vllm_fa, q, k_layers, v_layers, seqlens, table, torch.empty_like(q), layers,
                                           sink_logits, window, descales)
    if (fa3 is None and vllm_fa is None and not serve and not sinks and not fp8 and window < 0 and layers == 1
            and b * ctx <= 1 << 20):
        def gathered(i):
            k = k_cache[table.long()].view(b, ctx, hkv, d).transpose(1, 2)
            v = v_cache[table.long()].view(b, ctx, hkv, d).transpose(1, 2)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)
        impls["sdpa_gather"] = gathered
    def skipped(impl, exc):
        print(f"  {case}: {impl} skipped ({type(exc).__name__}: {str(exc)[:160]})", flush=True)

    rows = [Row("attn_decode", case, impl, t.median_ms, tbps=bytes_moved / t.median_ms / 1e9, extra=t.extra())
            for impl, t in time_impls(selected(impls), 1, on_error=skipped).items()]
    tk_row = next((r for r in rows if r.impl == "tk"), None)
    if (tk_row is not None and layers == 1 and not serve and b >= 8 and ctx >= 8192 and window < 0
            and not impls_subset()):
        # Where decode streams (issue 48's bar): the case's own K/V tensors read as fast as this GPU reads them
        try:
            ceiling = read_ceiling.read_ceiling_tbps([k_cache, v_cache], num_sms, time_per_call)
        except Exception as exc:  # noqa: BLE001  (a ceiling that cannot be measured must not cost the case)
            print(f"  {case}: no read ceiling ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
            ceiling = None
        if ceiling is not None:
            tk_row.extra.update(read_ceiling_tbps=round(ceiling, 3), tk_of_read_ceiling=round(tk_row.tbps / ceiling, 4))
            print(f"  {case}: read ceiling {ceiling:.2f} TB/s; tk at {tk_row.tbps / ceiling:.3f} of it", flush=True)
    return rows


def run(quick: bool = False) -> list[Row]:
    """All cases; TK_DECODE_SERVE_ONLY=1: the serve-layout cases alone."""
    rows = []
    serve_only = os.environ.get("TK_DECODE_SERVE_ONLY") == "1"
    for case in [] if serve_only else CASES[:4] if quick else CASES:
        rows += _case(*case)
        torch.cuda.empty_cache()
    serve_cases = [(c, False, 1) for c in SERVE_CASES] + [(SERVE_CASES[1], True, 1)]
    serve_cases += [(c, False, SERVE_LAYERS) for c in SERVE_CASES]
    for case, shuffle, layers in [] if quick else serve_cases:
        rows += _case(*case, SERVE_TABLE, serve=True, shuffle=shuffle, layers=layers)
        torch.cuda.empty_cache()
    for b, ctx, hq, hkv, page, d, sinks, window in [] if serve_only or quick else MODEL_CASES:
        rows += _case(b, ctx, hq, hkv, page, d=d, sinks=sinks, window=window)
        torch.cuda.empty_cache()
    for case in [] if serve_only or quick else FP8_CASES:
        rows += _case(*case, fp8=True)
        torch.cuda.empty_cache()
    for b in [] if serve_only or quick else (1, 8, 64):
        for fp8 in (False, True):
            rows += _case(b, 1024, 32, 8, 16, WIDE_TABLE, layers=WIDE_LAYERS, fp8=fp8)
            torch.cuda.empty_cache()
    return rows
