"""Tune the split-KV decode plans on the GPU and write them to tk_backend/configs/<gpu>.json (the `decode` buckets).

    python scripts/tune.py [--out tk_backend/configs/h200.json] [--quick] [--kv-cache-dtype 16bit|fp8_e4m3]

For each bucket of batch shapes (batch x max context x GQA group, any q_len <= 16, head dim 128) it times
flash_attn_with_kvcache at the bucket's representative shape for every candidate KV chunk size (forced through
num_splits), by CUDA-graph replay, in two extremes of a fixed-shape batch: every sequence at the full context
(throughput) and one sequence at the full context with the others at 1/64 of it (latency: the long sequence
must still be spread over the SMs), each with the per-step coarsening the table's chunk would get (so the full
batch is timed at the chunk its steps would double to). The chosen chunk minimises the larger of its two slowdowns against the best
chunk of each extreme. Shapes outside every bucket keep decode_plan's analytic model.
--kv-cache-dtype fp8_e4m3 tunes FP8 (e4m3) caches the way vLLM hands them to TK (an e4m3 query, per-tensor
descales) into buckets of their own ("kv_dtype": ["fp8_e4m3"]); the table's buckets for other kinds stay (a bucket
that listed both loses the tuned kind), so the two kinds are tuned in separate runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchlib import ROOT, commit_of_tree, time_per_call  # noqa: E402

from tk_backend import attention, decode_plan  # noqa: E402

PAGE, D, HKV = 16, 128, 8
# (low, high, representative) per dimension; every combination is one bucket.
BATCH = [(1, 1, 1), (2, 16, 8), (17, 96, 64), (97, 4096, 256)]
CONTEXT = [(1, 2048, 1024), (2049, 16384, 8192), (16385, 65536, 32768), (65537, 1 << 20, 131072)]
GROUP = [(1, 4, 4), (5, 64, 8)]
CHUNKS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


KV_BYTES_CAP = 48 << 30  # K and V of a representative batch: the long-context buckets test fewer sequences


def representative_batch(batch: int, ctx: int) -> int:
    return max(1, min(batch, KV_BYTES_CAP // (ctx * HKV * D * 2 * 2)))


def tune_bucket(batch: int, ctx: int, group: int, kv_dtype: str = "16bit") -> tuple[int, dict]:
    blocks = batch * ctx // PAGE
    k = torch.randn(blocks, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, ctx // PAGE)
    q = torch.randn(batch, 1, HKV * group, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    descales, cache_dtype = {}, None
    if kv_dtype == "fp8_e4m3":  # as vLLM hands an fp8 cache's step to TK: e4m3 caches and query, per-tensor scales
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = [torch.full((1, 1), x, device="cuda").expand(batch, HKV) for x in (0.05, 1.0, 1.0)]
        q = (q.float() / 0.05).to(torch.float8_e4m3fn)
        descales = dict(zip(("q_descale", "k_descale", "v_descale"), scales))
        cache_dtype = k.dtype
    full = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    skew = torch.full((batch,), max(ctx // 64, 1), dtype=torch.int32, device="cuda")
    skew[0] = ctx

    num_sms, name = attention._device_info(q.device)
    workspaces = attention.DecodeWorkspacePool()  # the bucket's: freed with it

    def time(lengths: torch.Tensor, chunk: int) -> float:
        # the candidate chunk as the plan's, with the coarsening a table entry would get (decode_plan.coarsened)
        forced = decode_plan.make_plan(batch, ctx, 1, HKV * group, HKV, D, PAGE, num_sms, -1, math.ceil(ctx / chunk),
                                       name, kv_dtype)
        plan = decode_plan.coarsened(forced)

        def call(i):  # planned each call, as flash_attn_with_kvcache: every call works out its schedule
            decode = attention.PagedDecode(workspaces).plan(lengths, table, num_q_heads=HKV * group, num_kv_heads=HKV,
                                                            head_dim=D, page_size=PAGE, split_plan=plan,
                                                            kv_cache_dtype=cache_dtype)
            decode.run(q, k, v, out, **descales)
        return time_per_call(call, 1, replays=5, target_ms=5.0)

    chunks = [c for c in CHUNKS if c <= ctx] or [CHUNKS[0]]
    times = {c: (time(full, c), time(skew, c)) for c in chunks}
    del k, v, workspaces
    torch.cuda.empty_cache()
    best_full = min(t[0] for t in times.values())
    best_skew = min(t[1] for t in times.values())
    score = {c: max(t[0] / best_full, t[1] / best_skew) for c, t in times.items()}
    chosen = min(chunks, key=lambda c: (score[c], -c))
    return chosen, {str(c): {"full_ms": round(t[0], 5), "skew_ms": round(t[1], 5)} for c, t in times.items()}


def merged_buckets(old: list[dict], tuned: list[dict], kv_dtype: str) -> list[dict]:
    """The table's buckets after tuning kv_dtype: the tuned ones first, then the old ones for other kinds (a bucket
    without "kv_dtype" is 16-bit; one that listed kv_dtype among others keeps the others)."""
    kept = []
    for bucket in old:
        kinds = [k for k in bucket.get("kv_dtype", ["16bit"]) if k != kv_dtype]
        if kinds:
            kept.append({**bucket, "kv_dtype": kinds} if "kv_dtype" in bucket or kinds != ["16bit"] else bucket)
    return tuned + kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "tk_backend" / "configs" / "h200.json")
    ap.add_argument("--quick", action="store_true", help="two buckets only (smoke run), nothing written")
    ap.add_argument("--kv-cache-dtype", choices=tuple(decode_plan.KV_DTYPE_BYTES), default="16bit",
                    help="the caches' element kind to tune (default 16bit)")
    args = ap.parse_args()
    kind = args.kv_cache_dtype
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("tune.py tunes Hopper (sm_90) kernels and needs an H100/H200.", file=sys.stderr)
        return 2
    buckets, measured = [], []
    shapes = [(b, c, g) for b in BATCH for c in CONTEXT for g in GROUP]
    for (b_lo, b_hi, b), (c_lo, c_hi, c), (g_lo, g_hi, g) in shapes[:2] if args.quick else shapes:
        b = representative_batch(b, c)
        chunk, times = tune_bucket(b, c, g, kind)
        print(f"{kind} batch {b:4d} ctx {c:6d} group {g}: chunk {chunk:6d}   {times}", flush=True)
        bucket = {"batch": [b_lo, b_hi], "max_context": [c_lo, c_hi], "q_len": [1, 16], "group": [g_lo, g_hi],
                  "head_dim": [128], "chunk_tokens": chunk, "source": "tuned"}
        buckets.append(bucket if kind == "16bit" else {**bucket, "kv_dtype": [kind]})
        measured.append({"batch": b, "max_context": c, "group": g, "kv_dtype": kind, "chunk_tokens": chunk,
                         "times": times})
    if args.quick:
        return 0
    doc = json.loads(args.out.read_text()) if args.out.exists() else {}
    old = doc.get("decode", {})
    buckets = merged_buckets(old.get("buckets", []), buckets, kind)
    measured += [m for m in old.get("measured", []) if m.get("kv_dtype", "16bit") != kind]
    doc["device"] = torch.cuda.get_device_name()
    doc["decode"] = {
        "_doc": ("Paged-decode split-KV plans (tk_backend/decode_plan.py), written by scripts/tune.py: the first "
                 "bucket whose inclusive ranges contain the batch shape wins; other shapes use the analytic model. "
                 "Each bucket was tuned at a representative shape (Hkv 8, head dim 128, page 16, q_len 1) over "
                 "full-context and skewed batches; `measured` keeps the timings; `tuned` says when each cache "
                 "kind's buckets were (commit and date: the newest run's)."),
        "commit": commit_of_tree(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "buckets": buckets,
        "measured": measured,
    }
    doc["decode"]["tuned"] = {**old.get("tuned", {"16bit": {"commit": old.get("commit"), "date": old.get("date")}}),
                              kind: {"commit": doc["decode"]["commit"], "date": doc["decode"]["date"]}}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
