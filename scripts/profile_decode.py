"""Profile one paged-decode shape: plan, per-kernel CUDA times (torch profiler), for use under ncu.

    python scripts/profile_decode.py B CTX HQ HKV [--iters N] [--page P] [--table TOKENS] [--fp8]

--table pads the block table to TOKENS tokens a row (columns never read), as vLLM's max_model_len-wide table is.
--fp8: e4m3 caches with per-tensor descales expanded to [batch, kv heads], as vLLM passes them. Under ncu, e.g.
`ncu --set full -k regex:lcsf -c 1 python scripts/profile_decode.py 64 8192 32 8 --fp8 --iters 1`.
"""
from __future__ import annotations

import argparse

import sys
from pathlib import Path

import torch

import tk_backend
from tk_backend import attention, decode_plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs=4, type=int)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--table", type=int, default=0)
    ap.add_argument("--fp8", action="store_true", help="float8_e4m3fn caches with per-tensor descales")
    args = ap.parse_args()
    b, ctx, hq, hkv = args.shape
    d, page = 128, args.page
    blocks = b * ctx // page
    k = torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(b, ctx // page)
    if args.table > ctx:
        table = torch.cat([table, table[:, :1].expand(b, (args.table - ctx) // page)], 1).contiguous()
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    descales = {}
    if args.fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        one = torch.ones(1, 1, device="cuda")
        descales = {"k_descale": one.expand(b, hkv), "v_descale": (0.5 * one).expand(b, hkv)}
    kv_dtype = decode_plan.kv_dtype_of(k.dtype)
    num_sms, name = attention._device_info(q.device)
    print(decode_plan.make_plan(b, table.shape[1] * page, 1, hq, hkv, d, page, num_sms, -1, 0, name, kv_dtype))
    for _ in range(3):
        tk_backend.flash_attn_with_kvcache(q, k, v, lens, table, **descales)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            tk_backend.flash_attn_with_kvcache(q, k, v, lens, table, **descales)
        torch.cuda.synchronize()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchlib import time_per_call

    scale = d ** -0.5
    plan = decode_plan.make_plan(b, table.shape[1] * page, 1, hq, hkv, d, page, num_sms, -1, 0, name, kv_dtype)
    ws = decode_plan.DecodeWorkspace.allocate(plan, q.device)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, 1, dtype=torch.float32, device="cuda")

    def kernel_only(i):
        torch.ops.tk.attn_decode(q, k, v, lens, table, ws.work_items, ws.cta_start, ws.partial_out, ws.partial_lse,
                                 plan.chunk_tokens, plan.item_overhead_tokens, plan.coarsen_levels, False,
                                 decode_plan.kv_tile(plan, False), False, scale, True, -1,
                                 -1, 0.0, None, out, lse, **descales)

    parts = {
        "public op": lambda i: tk_backend.flash_attn_with_kvcache(q, k, v, lens, table, **descales),
        "attn_decode op only": kernel_only,
        "build_work_list only": lambda i: decode_plan.build_work_list(plan, lens, ws),
    }
    for label, call in parts.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            call(0)
        end.record()
        torch.cuda.synchronize()
        print(f"{label:24s} eager {start.elapsed_time(end) / 50 * 1e3:8.1f} us   graph {time_per_call(call, 1) * 1e3:8.1f} us")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
