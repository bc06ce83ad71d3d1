"""TK's Mamba-2 ops at a serving step's shapes, timed alone: is either the reason a served Mamba-2 model is slow?

    python3 scripts/probe_mamba_ops.py [--heads 80 --headdim 64 --dstate 128 --batch 128 --slots 300]

The decode update is called the way vLLM 0.26's MambaMixer2 calls it (dt, A, D, dt_bias as expanded views, state
rows picked from a pool by state_batch_indices); the varlen scan on a prefill step of equal-length sequences
(vLLM's chunked prefill: 16384 tokens of 512-token prompts). Prints each op's time, eager and by CUDA-graph
replay, the bytes it must move and the rate, and its error against tk_backend.reference on the same inputs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import time_per_call  # noqa: E402

from tk_backend import mamba as tkm  # noqa: E402
from tk_backend import reference  # noqa: E402


def eager_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def update_case(batch: int, heads: int, headdim: int, dstate: int, groups: int, slots: int, dtype) -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    state = torch.randn(slots, heads, headdim, dstate, device=dev, dtype=dtype, generator=g) * 0.1
    x = torch.randn(batch, heads, headdim, device=dev, dtype=dtype, generator=g)
    dt = torch.randn(batch, heads, device=dev, dtype=dtype, generator=g)[:, :, None].expand(-1, -1, headdim)
    A = (-torch.rand(heads, device=dev, generator=g))[:, None, None].expand(-1, headdim, dstate).to(torch.float32)
    B = torch.randn(batch, groups, dstate, device=dev, dtype=dtype, generator=g)
    C = torch.randn(batch, groups, dstate, device=dev, dtype=dtype, generator=g)
    D = torch.randn(heads, device=dev, generator=g)[:, None].expand(-1, headdim)
    dt_bias = torch.randn(heads, device=dev, generator=g)[:, None].expand(-1, headdim)
    idx = (torch.randperm(slots - 1, device=dev, generator=g)[:batch] + 1).to(torch.int32)  # slot 0: vLLM's null
    out = torch.empty_like(x)

    def call(_i: int = 0):
        tkm.selective_state_update(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True,
                                   state_batch_indices=idx, pad_slot_id=0, out=out)

    ref_state = state.float().clone()
    y_ref = reference.selective_state_update(ref_state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True,
                                             state_batch_indices=idx, pad_slot_id=0)
    before = state.clone()
    call()
    err_y = (out.float() - y_ref.float()).abs().max().item()
    err_s = (state[idx.long()].float() - ref_state[idx.long()]).abs().max().item()
    state.copy_(before)
    e = eager_ms(call)
    r = time_per_call(call, 1)
    moved = 2 * batch * heads * headdim * dstate * state.element_size()
    print(f"update b{batch} h{heads} p{headdim} n{dstate} g{groups} {dtype}: eager {e * 1e3:.1f} us, graph "
          f"{r * 1e3:.1f} us, {moved / (r * 1e-3) / 1e12:.2f} TB/s of state; max err y {err_y:.2e} state {err_s:.2e}",
          flush=True)


def scan_case(seqs: int, seqlen: int, heads: int, headdim: int, dstate: int, groups: int, chunk: int, dtype) -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    tokens = seqs * seqlen
    x = torch.randn(tokens, heads, headdim, device=dev, dtype=dtype, generator=g)
    dt = torch.randn(tokens, heads, device=dev, dtype=dtype, generator=g)
    A = -torch.rand(heads, device=dev, generator=g)
    B = torch.randn(tokens, groups, dstate, device=dev, dtype=dtype, generator=g)
    C = torch.randn(tokens, groups, dstate, device=dev, dtype=dtype, generator=g)
    D = torch.randn(heads, device=dev, generator=g)
    dt_bias = torch.randn(heads, device=dev, generator=g)
    cu = torch.arange(0, tokens + 1, seqlen, device=dev, dtype=torch.int32)
    out = torch.empty_like(x)

    def call(_i: int = 0):
        return tkm.mamba_chunk_scan_varlen(x, dt, A, B, C, cu, chunk_size=chunk, D=D, dt_bias=dt_bias,
                                           dt_softplus=True, out=out)

    e = eager_ms(call)
    r = time_per_call(call, 1)
    moved = tokens * (2 * heads * headdim + 2 * groups * dstate + heads) * x.element_size()
    print(f"scan {seqs}x{seqlen} h{heads} p{headdim} n{dstate} g{groups} c{chunk}: eager {e * 1e3:.1f} us, graph "
          f"{r * 1e3:.1f} us, {moved / (r * 1e-3) / 1e12:.2f} TB/s of activations", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=128)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--slots", type=int, default=300)
    args = ap.parse_args()
    h, p, n, grp = args.heads, args.headdim, args.dstate, args.groups
    for batch in (1, 32, 128, 256):
        update_case(min(batch, args.slots - 1), h, p, n, grp, args.slots, torch.bfloat16)
    update_case(128, h, p, n, grp, args.slots, torch.float16)
    for seqs, seqlen in ((32, 512), (8, 2048), (1, 8192), (128, 128)):
        scan_case(seqs, seqlen, h, p, n, grp, 256, torch.bfloat16)


if __name__ == "__main__":
    main()
