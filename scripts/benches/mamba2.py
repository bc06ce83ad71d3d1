"""Mamba-2 SSD family: tk's chunked scan vs mamba_ssm's Triton mamba_chunk_scan_combined and vLLM's Triton varlen
scan, same inputs, CUDA-graph replay. Paper cases (ThunderKittens: B=H=16, headdim 64, dstate 64, chunk 64) and
serving cases (8 packed sequences of random lengths summing to 8192 tokens, 80 heads, dstate 128, chunk 256; and
one 8192-token sequence alone; Falcon-H1-1.5B's 48 heads at dstate 256), and the decode state update (kernel
mamba2_update) against vLLM's Triton one.

Peers are imported lazily: mamba_ssm from the pure-Python wheel in .whl_ssm (its package __init__ imports the
compiled selective_scan_cuda, which this module stubs in a temp dir), and vLLM's mamba_chunk_scan_combined_varlen,
called exactly as vLLM 0.26's MambaMixer2 calls it (the same signature in 0.33): positional x, dt, A, B, C,
chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx, out, with chunk metadata built the way
its metadata builder does. A peer that cannot be imported or fails is skipped with a "mamba2_ssd: SKIPPED ..."
line, printed when it happens and again, with every other skip, as the family's last output (so a `| tail`
of the run still shows it), and noted on the tk row of the case. Each peer's output is also checked against
tk's on the timed inputs (max |difference| printed), so a row always measures a call that computed the scan.
"""
from __future__ import annotations

import math
import os
import random
import sys
import tempfile
import traceback

import torch

import tk_backend
from benchlib import Row, copies_to_defeat_l2, selected, time_per_call

PAPER = [(16, n, 16, 64, 64, 1, 64) for n in (1024, 4096, 16384)]  # batch, seqlen, heads, headdim, dstate, groups, chunk
# heads, headdim, dstate, groups, chunk, sequences: 8 packed prompts, and one 8k prompt alone (a chunked-prefill step of a
# long prompt: the scan's chain over its chunks is the whole time, where vLLM's Triton scan works on the chunks at once);
# Falcon-H1-1.5B's mixer (dstate 256) last
SERVING = [(80, 64, 128, 1, 256, 8), (80, 64, 128, 8, 256, 8), (80, 64, 128, 1, 256, 1), (48, 64, 256, 1, 256, 8)]
SERVING_TOKENS = 8192
# Decode state updates (kernel mamba2_update), as the served models call them: Mamba2-2.7B's layer (80 heads,
# 1 group) at batch 1-256, NemotronH-8B's (128 heads, 8 groups), Falcon-H1-1.5B's (48 heads, dstate 256) at batch
# 1-128 (where tk_backend.vllm.mamba.tk_update_faster draws its line).
UPDATE = [(1, 80, 64, 128, 1), (32, 80, 64, 128, 1), (128, 80, 64, 128, 1), (256, 80, 64, 128, 1),
          (128, 128, 64, 128, 8), (1, 48, 64, 256, 1), (32, 48, 64, 256, 1),
          (128, 48, 64, 256, 1), (128, 128, 64, 128, 8, torch.float32)]  # batch, heads, headdim, dstate, groups
# [, the state's dtype: bf16 unless given; NemotronH keeps its SSM states in float32 (case name + _f32state)]


SKIPPED: list[str] = []


def _wanted(kernel: str, case: str) -> bool:
    """$TK_BENCH_CASES (comma-separated substrings of "kernel:case", e.g. `mamba2_update:`) selects cases; unset: all."""
    only = [c for c in os.environ.get("TK_BENCH_CASES", "").split(",") if c]
    return not only or any(c in f"{kernel}:{case}" for c in only)


def _skip(peer: str, why: str, exc: BaseException | None = None) -> str:
    """Say loudly (stdout and stderr, flushed) that a peer is left out, and remember it for the summary."""
    line = f"mamba2_ssd: SKIPPED {peer}: {why}"
    if exc is not None:
        where = traceback.extract_tb(exc.__traceback__)[-1:]
        at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
        line += f" ({type(exc).__name__}: {exc}{at})"
    SKIPPED.append(line)
    print(line, flush=True)
    print(line, file=sys.stderr, flush=True)
    return line


def _mamba_ssm():
    try:
        stub = tempfile.mkdtemp(prefix="tk_stub_")
        with open(f"{stub}/selective_scan_cuda.py", "w") as f:
            f.write("# stub: mamba_ssm's package __init__ imports this compiled module; the Triton SSD does not use it\n")
        sys.path.append(stub)
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception as exc:  # noqa: BLE001 (any import failure means: skip this peer)
        _skip("mamba_ssm", "cannot import mamba_ssm.ops.triton.ssd_combined", exc)
        return None


def _vllm():
    try:
        import vllm
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
        print(f"mamba2_ssd: vllm_triton is vLLM {vllm.__version__}'s mamba_chunk_scan_combined_varlen", flush=True)
        return mamba_chunk_scan_combined_varlen
    except Exception as exc:  # noqa: BLE001
        _skip("vllm_triton", "cannot import vllm.model_executor.layers.mamba.ops.ssd_combined "
              "(GPU host: source /tmp/vllm_site/env.sh and keep /tmp/vllm_site on PYTHONPATH)", exc)
        return None


def _vllm_chunk_metadata(lengths: list[int], chunk: int, device, computed: list[int] | None = None) -> dict:
    """The chunk metadata vLLM's Mamba metadata builder makes (BaseMambaAttentionMetadataBuilder.
    _compute_chunk_metadata, 0.26): chunks never straddle sequences and end on multiples of chunk in each
    sequence's absolute positions (a first short chunk finishes a partly computed one). computed[s] = tokens
    sequence s already has in its state (0: chunks start at the sequence start)."""
    computed = computed or [0] * len(lengths)
    bounds, seq_idx, last = [], [], []
    pos = 0
    for s, (n, done) in enumerate(zip(lengths, computed)):
        if done % chunk:
            take = min(-(-done // chunk) * chunk - done, n)
            seq_idx.append(s)
            bounds.append(pos)
            pos, n = pos + take, n - take
        for _ in range(-(-n // chunk)):
            take = min(chunk, n)
            seq_idx.append(s)
            bounds.append(pos)
            pos, n = pos + take, n - take
        last.append(len(bounds) - 1)
    bounds.append(pos)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return dict(cu_seqlens=as_t(cu), cu_chunk_seqlens=as_t(bounds), seq_idx=as_t(seq_idx), last_chunk_indices=as_t(last))


def _timed(kernel: str, case: str, name: str, call, sets: int, per_set: int, check=None) -> Row | str:
    """name's row (check() first, if given: it raises when the peer's result differs from tk's), or the skip line of
    a peer that failed (tk's own failure raises)."""
    try:
        if check is not None:
            check()
        ms = time_per_call(call, sets)
    except Exception as exc:  # noqa: BLE001 (a peer's API drift must not sink the family)
        if name == "tk":
            raise
        return _skip(name, f"failed on {kernel} {case}", exc)
    return Row(kernel, case, name, ms, tbps=per_set / ms / 1e9)


def _vllm_update():
    try:
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
        return selective_state_update  # the Triton kernel behind vLLM's default SSU backend ("triton")
    except Exception as exc:  # noqa: BLE001
        _skip("vllm_triton update", "cannot import vllm.model_executor.layers.mamba.ops.mamba_ssm", exc)
        return None


def _update_rows(vllm_update, quick: bool) -> list[Row]:
    """One decode step's state update, called as vLLM 0.26's MambaMixer2 calls it: dt, A, D and dt_bias as
    expanded per-head views, the batch's state rows picked from a pool by state_batch_indices (slot 0, vLLM's
    null block, unused), the state in the activations' dtype (or the case's), y into a preallocated out. Bytes:
    the state rows read and written (what bounds the step)."""
    rows = []
    for batch, heads, headdim, dstate, groups, *state_dtype in UPDATE[2:3] if quick else UPDATE:
        state_dtype = state_dtype[0] if state_dtype else torch.bfloat16
        case = f"b{batch}_h{heads}_p{headdim}_s{dstate}_g{groups}"
        case += "_f32state" if state_dtype == torch.float32 else ""
        if not _wanted("mamba2_update", case):
            continue
        slots = batch + 1
        per_set = 2 * batch * heads * headdim * dstate * state_dtype.itemsize
        sets = copies_to_defeat_l2(per_set, cap=4)
        g = torch.Generator(device="cuda").manual_seed(batch)
        dev, bf = "cuda", torch.bfloat16
        A = (-torch.rand(heads, device=dev, generator=g))[:, None, None].expand(-1, headdim, dstate).float()
        D = torch.randn(heads, device=dev, generator=g)[:, None].expand(-1, headdim)
        dt_bias = torch.randn(heads, device=dev, generator=g)[:, None].expand(-1, headdim)
        inp = [dict(state=torch.randn(slots, heads, headdim, dstate, device=dev, dtype=state_dtype, generator=g) * 0.1,
                    x=torch.randn(batch, heads, headdim, device=dev, dtype=bf, generator=g),
                    dt=torch.randn(batch, heads, device=dev, dtype=bf, generator=g)[:, :, None].expand(-1, -1, headdim),
                    B=torch.randn(batch, groups, dstate, device=dev, dtype=bf, generator=g),
                    C=torch.randn(batch, groups, dstate, device=dev, dtype=bf, generator=g),
                    idx=(torch.randperm(batch, device=dev, generator=g) + 1).to(torch.int32),
                    out=torch.empty(batch, heads, headdim, device=dev, dtype=bf)) for _ in range(sets)]

        def tk_call(i):
            d = inp[i]
            tk_backend.selective_state_update(d["state"], d["x"], d["dt"], A, d["B"], d["C"], D=D, dt_bias=dt_bias,
                                              dt_softplus=True, state_batch_indices=d["idx"], pad_slot_id=0,
                                              out=d["out"])
        impls = {"tk": tk_call}
        if vllm_update is not None:
            def vllm_call(i):
                d = inp[i]
                vllm_update(d["state"], d["x"], d["dt"], A, d["B"], d["C"], D, dt_bias, dt_softplus=True,
                            state_batch_indices=d["idx"], out=d["out"])
            impls["vllm_triton"] = vllm_call

        def same_as_tk():  # the same step on copies must give tk's y and state
            d = inp[0]
            s0 = d["state"].clone()
            tk_call(0)
            y_tk, s_tk = d["out"].float().clone(), d["state"].float().clone()
            d["state"].copy_(s0)
            impls["vllm_triton"](0)
            torch.cuda.synchronize()
            diff = max((d["out"].float() - y_tk).abs().max().item(), (d["state"].float() - s_tk).abs().max().item())
            scale = max(y_tk.abs().max().item(), 1.0)
            print(f"mamba2_update: {case}: vllm_triton vs tk max |difference| {diff:.3g} (max |y| {scale:.3g})",
                  flush=True)
            if not math.isfinite(diff) or diff > 0.05 * scale:
                raise ValueError(f"vllm_triton's update differs from tk's by {diff:.3g}")
        for name, call in selected(impls).items():
            r = _timed("mamba2_update", case, name, call, sets, per_set, same_as_tk if name == "vllm_triton" else None)
            if isinstance(r, Row):
                rows.append(r)
        del inp
        torch.cuda.empty_cache()
    return rows


def _inputs(batch, seqlen, heads, headdim, dstate, groups, sets):
    def one():
        return dict(
            x=torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16),
            dt=torch.randn(batch, seqlen, heads, device="cuda", dtype=torch.float32) * 0.5 - 1.0,
            A=-torch.rand(heads, device="cuda") * 2 - 0.1,
            B=torch.randn(batch, seqlen, groups, dstate, device="cuda", dtype=torch.bfloat16) * 0.3,
            C=torch.randn(batch, seqlen, groups, dstate, device="cuda", dtype=torch.bfloat16) * 0.3,
            D=torch.randn(heads, device="cuda"), dt_bias=torch.randn(heads, device="cuda") * 0.3,
        )
    return [one() for _ in range(sets)]


def _bytes(batch, seqlen, heads, headdim, dstate, groups):
    return batch * seqlen * (2 * heads * headdim * 2 + 2 * groups * dstate * 2 + heads * 4)


def run(quick: bool = False) -> list[Row]:
    rows = []
    ssm, vllm = _mamba_ssm(), _vllm()
    for batch, seqlen, heads, headdim, dstate, groups, chunk in PAPER[:1] if quick else PAPER:
        case = f"b{batch}_h{heads}_n{seqlen}_p{headdim}_s{dstate}_g{groups}_c{chunk}"
        if not _wanted("mamba2_ssd", case):
            continue
        per_set = _bytes(batch, seqlen, heads, headdim, dstate, groups)
        sets = copies_to_defeat_l2(per_set, cap=4)
        inp = _inputs(batch, seqlen, heads, headdim, dstate, groups, sets)
        outs = [torch.empty_like(i["x"]) for i in inp]
        impls = {"tk": lambda i: tk_backend.mamba_chunk_scan_combined(**inp[i], chunk_size=chunk, dt_softplus=True,
                                                                      out=outs[i])}
        if ssm is not None:
            impls["mamba_ssm"] = lambda i: ssm(**inp[i], chunk_size=chunk, dt_softplus=True)
        for name, call in selected(impls).items():
            r = _timed("mamba2_ssd", case, name, call, sets, per_set)
            if isinstance(r, Row):
                rows.append(r)
        del inp, outs
        torch.cuda.empty_cache()
    rng = random.Random(0)
    for heads, headdim, dstate, groups, chunk, seqs in SERVING[:1] if quick else SERVING:
        case = f"varlen{seqs}_h{heads}_p{headdim}_s{dstate}_g{groups}_c{chunk}_8k"
        cuts = sorted(rng.sample(range(1, SERVING_TOKENS), seqs - 1))  # drawn for skipped cases too
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [SERVING_TOKENS])]
        if not _wanted("mamba2_ssd", case):
            continue
        meta = _vllm_chunk_metadata(lengths, chunk, "cuda")
        per_set = _bytes(1, SERVING_TOKENS, heads, headdim, dstate, groups)
        sets = copies_to_defeat_l2(per_set, cap=4)
        inp = _inputs(1, SERVING_TOKENS, heads, headdim, dstate, groups, sets)
        states0 = [torch.randn(seqs, heads, headdim, dstate, device="cuda") * 0.1 for _ in range(sets)]
        outs = [torch.empty_like(i["x"][0]) for i in inp]
        cu = meta["cu_seqlens"]

        def tk_call(i):
            d = inp[i]
            return tk_backend.mamba_chunk_scan_varlen(d["x"][0], d["dt"][0], d["A"], d["B"][0], d["C"][0], cu,
                                                      chunk_size=chunk, D=d["D"], dt_bias=d["dt_bias"],
                                                      initial_states=states0[i], dt_softplus=True, out=outs[i])
        impls = {"tk": tk_call}
        if vllm is not None:
            vllm_outs = [torch.empty_like(o) for o in outs]

            def vllm_call(i):  # exactly MambaMixer2's call (vLLM 0.26 / 0.33), states kept in float32
                d = inp[i]
                return vllm(d["x"][0], d["dt"][0], d["A"], d["B"][0], d["C"][0], chunk, meta["cu_seqlens"],
                            meta["cu_chunk_seqlens"], meta["last_chunk_indices"], meta["seq_idx"], vllm_outs[i],
                            D=d["D"], z=None, dt_bias=d["dt_bias"], initial_states=states0[i], dt_softplus=True,
                            dt_limit=(0.0, math.inf), return_intermediate_states=False, state_dtype=torch.float32)
            impls["vllm_triton"] = vllm_call
        def same_as_tk():  # a wrong call must not time as a fast one
            tk_call(0)
            impls["vllm_triton"](0)
            torch.cuda.synchronize()
            diff = (vllm_outs[0].float() - outs[0].float()).abs().max().item()
            scale = outs[0].float().abs().max().item()
            print(f"mamba2_ssd: {case}: vllm_triton vs tk max |y difference| {diff:.3g} (max |y| {scale:.3g})",
                  flush=True)
            if not math.isfinite(diff) or diff > 0.05 * max(scale, 1.0):
                raise ValueError(f"vllm_triton's output differs from tk's by {diff:.3g} (max |y| {scale:.3g})")
        notes = []
        for name, call in selected(impls).items():
            r = _timed("mamba2_ssd", case, name, call, sets, per_set, same_as_tk if name == "vllm_triton" else None)
            if isinstance(r, Row):
                rows.append(r)
            else:
                notes.append(r.removeprefix("mamba2_ssd: "))
        if vllm is None:
            notes.append("vllm_triton skipped (not importable)")
        for r in rows:
            if r.case == case and r.impl == "tk" and notes:
                r.note = "; ".join(notes)
        del inp, outs, states0
        torch.cuda.empty_cache()
    rows += _update_rows(_vllm_update() if vllm is not None else None, quick)
    for line in SKIPPED:  # again, last, so that a `| tail` of the run shows every skipped peer
        print(line, flush=True)
    if not SKIPPED:
        print("mamba2_ssd: every peer ran (mamba_ssm, vllm_triton)", flush=True)
    return rows
