"""Two kernels side by side under Nsight Compute: the metrics of a few sections, as one text table.

    python3 scripts/ncu_pair.py prefill [B H N D] [--causal] [--stalls]  # tk's prefill kernel vs FA3's, same inputs
    python3 scripts/ncu_pair.py prefill [B H N D] [--causal] --sass      # tk's kernel alone: stall samples per SASS
                                                                         # instruction (where its warps wait);
                                                                         # --side fa3 samples FA3's instead
    python3 scripts/ncu_pair.py based_step                     # tk's Based decode step vs a copy of its bytes
    python3 scripts/ncu_pair.py gemm [M N K]                   # tk's GEMM vs cuBLAS (torch.matmul), bf16
    python3 scripts/ncu_pair.py ssd                            # tk's Mamba-2 scan: the bench's paper case
                                                               # (n4096, dstate 64) vs its serving case (dstate 128)
    python3 scripts/ncu_pair.py decode [B CTX HQ HKV D PAGE]   # tk's split-KV decode kernel vs FA3's (page_table),
                                                               # shuffled pages (default 8 8192 32 8 128 16)
    python3 scripts/ncu_pair.py decode ... --peer vllm_fa3     # ... vs vLLM's FA3 build as its FLASH_ATTN backend
                                                               # calls it (scheduler metadata, 32 splits; needs vLLM)

Each side runs under `ncu --csv --page details` on its own process (skipping warm-up launches) and the table
lists every metric both report, so what limits tk (tensor pipe, issue stalls, memory, occupancy) reads off
against a kernel that does the same work faster. Full output lands in $OUT/ncu_*.csv.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats",
            "SchedulerStats", "Occupancy", "LaunchStats"]

BASED_STEP = """
import sys
import torch
sys.path.insert(0, {repo!r})
from tk_backend import based
b, h, f, d = 256, 16, 16, 64  # the bench's step case
q, k = (torch.randn(b, h, f, device="cuda", dtype=torch.bfloat16) for _ in range(2))
v = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
state = based.empty_state(b, h, d, "cuda")
for t in state:
    t.normal_()
src = torch.empty(sum(t.numel() for t in state), device="cuda")
dst = torch.empty_like(src)
for _ in range(4):
    if {side!r} == "tk":
        based.based_step(q, k, v, state, inplace=True)
    else:
        dst.copy_(src)
torch.cuda.synchronize()
"""

SSD = """
import random
import sys
import torch
sys.path.insert(0, {repo!r})
import tk_backend
paper = {side!r} == "paper"
heads, headdim, dstate, chunk = (16, 64, 64, 64) if paper else (80, 64, 128, 256)
batch, seqlen = (16, 4096) if paper else (1, 8192)
x = torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16)
dt = torch.randn(batch, seqlen, heads, device="cuda") * 0.5 - 1.0
A, D, dt_bias = -torch.rand(heads, device="cuda") * 2 - 0.1, torch.randn(heads, device="cuda"), torch.zeros(heads, device="cuda")
B, C = (torch.randn(batch, seqlen, 1, dstate, device="cuda", dtype=torch.bfloat16) * 0.3 for _ in range(2))
if paper:
    call = lambda: tk_backend.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
else:  # the bench's first serving batch: 8 sequences of random lengths (seed 0)
    cuts = sorted(random.Random(0).sample(range(1, seqlen), 7))
    cu = torch.tensor([0, *cuts, seqlen], device="cuda", dtype=torch.int32)
    states = torch.randn(8, heads, headdim, dstate, device="cuda") * 0.1
    call = lambda: tk_backend.mamba_chunk_scan_varlen(x[0], dt[0], A, B[0], C[0], cu, chunk_size=chunk, D=D,
                                                      dt_bias=dt_bias, initial_states=states, dt_softplus=True)
for _ in range(4):
    call()
torch.cuda.synchronize()
"""

GEMM = """
import sys
import torch
sys.path.insert(0, {repo!r})
import tk_backend
m, n, k = {shape!r}
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
for _ in range(4):
    tk_backend.gemm(a, b) if {side!r} == "tk" else torch.matmul(a, b)
torch.cuda.synchronize()
"""

DECODE = """
import sys
import torch
sys.path.insert(0, {repo!r})
import tk_backend
b, ctx, hq, hkv, d, page = {shape!r}
blocks = b * ctx // page
k_cache, v_cache = (torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
table = torch.randperm(blocks, device="cuda").to(torch.int32).view(b, ctx // page)
seqlens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
if {side!r} == "tk":
    call = lambda: tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table)
elif {side!r} == "vllm_fa3":  # as scripts/benches/decode.py's vllm_fa3 impl
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    meta = get_scheduler_metadata(batch_size=b, max_seqlen_q=1, max_seqlen_k=ctx, num_heads_q=hq, num_heads_kv=hkv,
                                  headdim=d, cache_seqlens=seqlens, qkv_dtype=q.dtype, cu_seqlens_q=cu_q,
                                  page_size=page, causal=True, num_splits=32)
    call = lambda: flash_attn_varlen_func(q.view(b, hq, d), k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=cu_q,
                                          max_seqlen_k=ctx, seqused_k=seqlens, softmax_scale=d ** -0.5, causal=True,
                                          block_table=table, scheduler_metadata=meta,
                                          num_splits=32, fa_version=3)
else:
    import flash_attn_interface as fa3
    call = lambda: fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=True)
for _ in range(4):
    call()
torch.cuda.synchronize()
"""


# --stalls: the warp-state breakdown (average warps stalled for each reason, per issued instruction), which ncu
# lists under "Command line profiler metrics". It averages every warp of the kernel, producers with consumers.
STALLS = r"regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"


def run_side(command: list[str], kernel_regex: str, label: str, out: Path, stalls: bool = False,
             tables: bool = False) -> dict[str, str]:
    ncu = ["ncu", "--csv", "--page", "details", "--kernel-name-base", "demangled", "-k", f"regex:{kernel_regex}",
           "-s", "2", "-c", "1"]
    for section in SECTIONS + (["MemoryWorkloadAnalysis_Tables"] if tables else []):
        ncu += ["--section", section]
    if stalls:
        ncu += ["--metrics", STALLS]
    proc = subprocess.run(ncu + command, cwd=REPO, capture_output=True, text=True, timeout=600)
    (out / f"ncu_{label}.csv").write_text(proc.stdout + "\n" + proc.stderr[-4000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith('"')]
    metrics = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        name = f"{row.get('Section Name', '')}: {row.get('Metric Name', '')} [{row.get('Metric Unit', '')}]"
        metrics[name] = row.get("Metric Value", "")
    if not metrics:
        print(f"{label}: ncu reported nothing (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return metrics


def source_rows(page: str) -> list[dict]:
    """The per-instruction table of ncu's source page (`--page source --print-source sass`, CSV): the page opens
    with a "Kernel Name" line; the table's header is the line that starts with "Address"."""
    lines = page.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), len(lines))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def count(row: dict, key: str) -> float:
    """A numeric cell of the source page: ncu writes "1,234", "" or "-"."""
    try:
        return float((row.get(key) or "0").replace(",", "") or 0)
    except ValueError:
        return 0.0


def sass_hotspots(command: list[str], kernel_regex: str, label: str, out: Path, top: int = 60) -> int:
    """tk's kernel alone under the SourceCounters section: ncu samples each warp's program counter and stall reason,
    and the source page lists them per SASS instruction. Saves the whole page ($OUT/ncu/sass_LABEL.csv) and prints
    the `top` instructions by samples, with their share of all samples."""
    rep = out / f"sass_{label}"
    ncu = ["ncu", "--kernel-name-base", "demangled", "-k", f"regex:{kernel_regex}", "-s", "2", "-c", "1",
           "--section", "SourceCounters", "--section", "WarpStateStats", "-f", "-o", str(rep)]
    proc = subprocess.run(ncu + command, cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"{label}: ncu failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return 1
    page = subprocess.run(["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", "source", "--print-source", "sass"],
                          capture_output=True, text=True, timeout=600)
    (out / f"sass_{label}.csv").write_text(page.stdout)
    rows = source_rows(page.stdout)
    key = next((k for k in (rows[0] if rows else {}) if k.startswith("Warp Stall Sampling (All")), None)
    if key is None:
        print(f"{label}: no stall samples on the source page (exit {page.returncode}):\n{page.stderr[-2000:]}\n"
              f"columns: {list(rows[0]) if rows else []}")
        return 1
    def samples(row: dict) -> float:
        return count(row, key)
    total = sum(samples(r) for r in rows) or 1.0
    # Per-reason sample columns (stall_barrier, stall_wait, ...; the "(Not Issued)" twins left out).
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    overall = {k: sum(count(r, k) for r in rows) for k in reasons}
    print(f"{label}: {len(rows)} instructions, {total:.0f} samples; by reason: " +
          " ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in sorted(overall.items(), key=lambda x: -x[1]) if v))
    print(f"top {top} (index, address, share, executions, instruction, reasons over 10% of its samples):")
    for i, r in sorted(enumerate(rows), key=lambda x: samples(x[1]), reverse=True)[:top]:
        n = samples(r) or 1.0
        why = " ".join(f"{k[6:]}:{100 * count(r, k) / n:.0f}" for k in reasons if count(r, k) > 0.1 * n)
        print(f"  {i:5d} {r.get('Address', '?'):>8}  {100 * samples(r) / total:5.2f}%  "
              f"{r.get('Instructions Executed', ''):>9}  {r.get('Source', '').strip()[:60]:60s} {why}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["prefill", "based_step", "ssd", "gemm", "decode"])
    parser.add_argument("shape", nargs="*", type=int, default=[16, 16, 4096, 128])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--stalls", action="store_true", help="add the stall reasons (see STALLS)")
    parser.add_argument("--sass", action="store_true", help="one side's kernel alone: stall samples per instruction")
    parser.add_argument("--side", help="with --sass, the side to sample (default tk; e.g. fa3 for its same-shape kernel)")
    parser.add_argument("--peer", choices=["fa3", "vllm_fa3"], default="fa3", help="decode's peer (default fa3)")
    parser.add_argument("--tables", action="store_true",
                        help="add the memory tables (L1 / L2 / DRAM traffic and hit rates by kind of access)")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp")) / "ncu"
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "prefill":
        base = [sys.executable, "scripts/profile_prefill.py", *map(str, args.shape), "--iters", "1"]
        base += ["--causal"] if args.causal else []
        sides = {"tk": (base + ["--impl", "tk"], "attn_prefill"), "fa3": (base + ["--impl", "fa3"], "flash")}
    elif args.what == "gemm":
        shape = tuple(args.shape[:3]) if len(args.shape) == 3 else (4096, 4096, 4096)
        sides = {s: ([sys.executable, "-c", GEMM.format(repo=str(REPO), side=s, shape=shape)], regex)
                 for s, regex in (("tk", "gemm_kernel"), ("cublas", "nvjet|xmma|gemm|cutlass"))}
    elif args.what == "decode":
        shape = tuple(args.shape) if len(args.shape) == 6 else (8, 8192, 32, 8, 128, 16)
        sides = {s: ([sys.executable, "-c", DECODE.format(repo=str(REPO), side=s, shape=shape)], regex)
                 for s, regex in (("tk", "attn_decode_split"), (args.peer, "FlashAttnFwd"))}
    elif args.what == "ssd":
        sides = {s: ([sys.executable, "-c", SSD.format(repo=str(REPO), side=s)], "ssd_scan_kernel")
                 for s in ("paper", "serving")}
    else:
        sides = {s: ([sys.executable, "-c", BASED_STEP.format(repo=str(REPO), side=s)], regex)
                 for s, regex in (("tk", "based_step"), ("copy", "direct_copy"))}
    suffix = "_causal" if args.causal else ""  # so that a full and a causal run in one call keep both files
    if args.sass:
        side = args.side or next(iter(sides))
        if side not in sides:
            parser.error(f"--side {side}: {args.what} has the sides {list(sides)}")
        command, regex = sides[side]
        return sass_hotspots(command, regex, f"{side}_{'_'.join(map(str, args.shape))}{suffix}", out)
    results = {label: run_side(cmd, regex, label + suffix, out, args.stalls, args.tables)
               for label, (cmd, regex) in sides.items()}
    a, b = results
    names = [n for n in results[a] if n in results[b]]
    width = max((len(n) for n in names), default=20)
    lines = [f"{'metric':<{width}}  {a:>18}  {b:>18}"]
    lines += [f"{n:<{width}}  {results[a][n]:>18}  {results[b][n]:>18}" for n in names]
    print("\n".join(lines))
    (out / f"pair_{args.what}{suffix}.txt").write_text("\n".join(lines) + "\n")
    return 0 if names else 1


if __name__ == "__main__":
    sys.exit(main())
