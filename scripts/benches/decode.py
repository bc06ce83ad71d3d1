"""Paged decode family: tk vs FA3 flash_attn_with_kvcache (page_table) if present, else SDPA on gathered KV.

Every impl is timed by CUDA-graph replay (as vLLM runs decode); tbps counts the bytes of Q, the K and V
actually attended, and O.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import tk_backend
from tk_backend import attention, decode_plan
from benchlib import Row, selected, time_per_call

D = 128
# (batch, context, hq, hkv, page): vLLM's default 16-token pages, and a few cases with 64-token pages.
CASES = [(b, c, 32, 8, 16) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768)] + [(1, 131072, 32, 8, 16)]
CASES += [(b, c, 64, 8, 16) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768)]
CASES += [(1, 32768, 32, 8, 64), (8, 8192, 32, 8, 64), (64, 8192, 32, 8, 64)]
# Serving shapes: vLLM's block table is max_model_len wide whatever the contexts, so the plan is chosen for
# that width (here a 128k-token model) while the step's sequences are short. Case names end in _table{tokens}.
WIDE_TABLE = 131072
CASES += [(b, 1024, 32, 8, 16, WIDE_TABLE) for b in (1, 8, 64)]


def _fa3():
    try:
        import flash_attn_interface
        return flash_attn_interface
    except ImportError:
        return None


def _case(b, ctx, hq, hkv, page, table_ctx=None) -> list[Row]:
    blocks = b * ctx // page
    k_cache = torch.randn(blocks, page, hkv, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(blocks, page, hkv, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(b, ctx // page)
    if table_ctx is not None:  # columns past the contexts (never read), as a max_model_len-wide table has
        table = torch.cat([table, table[:, :1].expand(b, (table_ctx - ctx) // page)], 1).contiguous()
    q = torch.randn(b, 1, hq, D, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    bytes_moved = 2 * (2 * b * ctx * hkv * D + 2 * b * hq * D)
    case = f"b{b}_ctx{ctx}_hq{hq}_hkv{hkv}_d{D}_page{page}" + (f"_table{table_ctx}" if table_ctx else "")
    num_sms, name = attention._device_info(q.device)
    plan = decode_plan.make_plan(b, table.shape[1] * page, 1, hq, hkv, D, page, num_sms, -1, 0, name)
    step = int(decode_plan.step_chunk(plan, seqlens.cpu()))
    print(f"  {case}: plan chunk_tokens={plan.chunk_tokens} max_splits={plan.max_splits} ctas={plan.num_ctas} "
          f"({plan.source}); this step's chunk {step} (coarsen_levels={plan.coarsen_levels})", flush=True)
    impls = {"tk": lambda i: tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out)}
    fa3 = _fa3()
    if fa3 is not None:
        impls["fa3"] = lambda i: fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                             page_table=table, causal=True)
    elif b * ctx <= 1 << 20:
        def gathered(i):
            k = k_cache[table.long()].view(b, ctx, hkv, D).transpose(1, 2)
            v = v_cache[table.long()].view(b, ctx, hkv, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)
        impls["sdpa_gather"] = gathered
    rows = []
    for impl, call in selected(impls).items():
        try:
            ms = time_per_call(call, 1)
        except Exception as exc:  # noqa: BLE001
            print(f"  {case}: {impl} skipped ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
            continue
        rows.append(Row("attn_decode", case, impl, ms, tbps=bytes_moved / ms / 1e9))
    return rows


def run(quick: bool = False) -> list[Row]:
    rows = []
    for case in CASES[:4] if quick else CASES:
        rows += _case(*case)
        torch.cuda.empty_cache()
    return rows
