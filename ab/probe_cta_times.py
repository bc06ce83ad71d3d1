"""Decode tail probe (with ab/decode-cta-times.patch built): per-CTA start / end times of the split-KV kernel for a
few schedules of one shape, and each schedule's graph-replay time. Prints `CONFIG name ctas ms` lines; the kernel's
probe_dump prints `PROBE cta start end smid` lines after each config's one dumped call (same order).

    python3 ab/probe_cta_times.py [B CTX]             (needs ab/decode-cta-times.patch built for the PROBE lines)
    python3 ab/probe_cta_times.py B CTX --only NAME   (that config, 6 plain calls: for ncu's per-kernel durations)
"""
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tk_backend  # noqa: E402
from tk_backend import attention, decode_balanced, decode_plan  # noqa: E402

only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
b, ctx = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 and sys.argv[1] != "--only" else (8, 8192)
hq, hkv, d, page = 32, 8, 128, 16
blocks = b * ctx // page
torch.manual_seed(0)
table = torch.randperm(blocks, device="cuda").to(torch.int32).view(b, ctx // page)
seqlens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
k_cache = torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
v_cache = torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
lse = torch.empty(b, hq, 1, dtype=torch.float32, device="cuda")
tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out)  # loads the kernels
torch.cuda.synchronize()
sms = torch.cuda.get_device_properties(0).multi_processor_count
base = decode_plan.make_plan(b, ctx, 1, hq, hkv, d, page, sms, -1, 0, torch.cuda.get_device_name(0))
print("base plan", base, flush=True)


def runner(plan, balanced, tile):
    items = decode_balanced.workspace_items(b, plan.num_ctas) if balanced else plan.max_items
    ws = attention._workspace(plan, q.device, items)

    def call():
        torch.ops.tk.attn_decode(q, k_cache, v_cache, seqlens, table, ws.work_items, ws.cta_start, ws.partial_out,
                                 ws.partial_lse, plan.chunk_tokens, plan.item_overhead_tokens, plan.coarsen_levels,
                                 balanced, tile, False, d ** -0.5, True, -1, -1, 0.0, out, lse)
    return call


configs = {"base": (base, False, decode_plan.kv_tile(base, False)),
           "balanced64": (base, True, 64)}
for chunk in (512, 1024, 2048, 4096):
    p = dataclasses.replace(base, chunk_tokens=chunk, max_splits=ctx // chunk, coarsen_levels=0)
    configs[f"chunk{chunk}_t64"] = (p, False, 64)
    configs[f"chunk{chunk}_t128"] = (p, False, 128)
ref = None
for name, (plan, balanced, tile) in configs.items():
    call = runner(plan, balanced, tile)
    if only is not None:
        if name == only:
            for _ in range(6):
                call()
            torch.cuda.synchronize()
        continue
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    if ref is None:
        ref = out.clone()
    err = (out.float() - ref.float()).abs().max().item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 200)
    ms = sorted(times)[3]
    ctas = plan.num_ctas if (balanced or plan.max_items > plan.num_ctas) else plan.max_items
    print(f"CONFIG {name} {ctas} {ms:.5f} maxdiff={err:.3g} tbps={2 * b * ctx * hkv * d * 2 / ms / 1e9:.3f}",
          flush=True)
    os.environ["TK_PROBE_DUMP"] = "1"
    call()
    torch.cuda.synchronize()
    del os.environ["TK_PROBE_DUMP"]
    sys.stdout.flush()
