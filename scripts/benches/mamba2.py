"""Mamba-2 SSD family: tk's chunked scan vs mamba_ssm's Triton mamba_chunk_scan_combined and vLLM's Triton varlen
scan, same inputs, CUDA-graph replay. Paper cases (ThunderKittens: B=H=16, headdim 64, dstate 64, chunk 64) and
serving cases (8 packed sequences of random lengths summing to 8192 tokens, 80 heads, dstate 128, chunk 256).

Peers are imported lazily and skipped with a printed reason when missing: mamba_ssm from the pure-Python wheel in
.whl_ssm (its package __init__ imports the compiled selective_scan_cuda, which this module stubs in a temp dir),
vLLM 0.26's mamba_chunk_scan_combined_varlen (called through its signature, which changed across versions).
"""
from __future__ import annotations

import inspect
import random
import sys
import tempfile

import torch

import tk_backend
from benchlib import Row, copies_to_defeat_l2, time_per_call

PAPER = [(16, n, 16, 64, 64, 1, 64) for n in (1024, 4096, 16384)]  # batch, seqlen, heads, headdim, dstate, groups, chunk
SERVING = [(80, 64, 128, 1, 256), (80, 64, 128, 8, 256)]            # heads, headdim, dstate, groups, chunk
SERVING_TOKENS, SERVING_SEQS = 8192, 8


def _mamba_ssm():
    try:
        stub = tempfile.mkdtemp(prefix="tk_stub_")
        with open(f"{stub}/selective_scan_cuda.py", "w") as f:
            f.write("# stub: mamba_ssm's package __init__ imports this compiled module; the Triton SSD does not use it\n")
        sys.path.append(stub)
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception as exc:  # noqa: BLE001 (any import failure means: skip this peer)
        print(f"mamba2_ssd: skipping mamba_ssm ({type(exc).__name__}: {exc})")
        return None


def _vllm():
    try:
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
        return mamba_chunk_scan_combined_varlen
    except Exception as exc:  # noqa: BLE001
        print(f"mamba2_ssd: skipping vllm_triton ({type(exc).__name__}: {exc})")
        return None


def _vllm_chunk_metadata(lengths: list[int], chunk: int, device) -> dict:
    """vLLM's chunk metadata: chunks never straddle sequences (cu_chunk_seqlens, seq_idx per chunk, last chunk)."""
    bounds, seq_idx, last = [0], [], []
    start = 0
    for s, n in enumerate(lengths):
        for c in range(start, start + n, chunk):
            bounds.append(min(c + chunk, start + n))
            seq_idx.append(s)
        last.append(len(seq_idx) - 1)
        start += n
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return dict(cu_seqlens=as_t(cu), cu_chunk_seqlens=as_t(bounds), seq_idx=as_t(seq_idx), last_chunk_indices=as_t(last))


def _call_by_name(fn, **kw):
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kw.items() if k in params})


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
        per_set = _bytes(batch, seqlen, heads, headdim, dstate, groups)
        sets = copies_to_defeat_l2(per_set, cap=4)
        inp = _inputs(batch, seqlen, heads, headdim, dstate, groups, sets)
        outs = [torch.empty_like(i["x"]) for i in inp]
        impls = {"tk": lambda i: tk_backend.mamba_chunk_scan_combined(**inp[i], chunk_size=chunk, dt_softplus=True,
                                                                      out=outs[i])}
        if ssm is not None:
            impls["mamba_ssm"] = lambda i: ssm(**inp[i], chunk_size=chunk, dt_softplus=True)
        for name, call in impls.items():
            ms = time_per_call(call, sets)
            rows.append(Row("mamba2_ssd", case, name, ms, tbps=per_set / ms / 1e9))
        del inp, outs
        torch.cuda.empty_cache()
    rng = random.Random(0)
    for heads, headdim, dstate, groups, chunk in SERVING[:1] if quick else SERVING:
        case = f"varlen{SERVING_SEQS}_h{heads}_p{headdim}_s{dstate}_g{groups}_c{chunk}_8k"
        cuts = sorted(rng.sample(range(1, SERVING_TOKENS), SERVING_SEQS - 1))
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [SERVING_TOKENS])]
        meta = _vllm_chunk_metadata(lengths, chunk, "cuda")
        per_set = _bytes(1, SERVING_TOKENS, heads, headdim, dstate, groups)
        sets = copies_to_defeat_l2(per_set, cap=4)
        inp = _inputs(1, SERVING_TOKENS, heads, headdim, dstate, groups, sets)
        states0 = [torch.randn(SERVING_SEQS, heads, headdim, dstate, device="cuda") * 0.1 for _ in range(sets)]
        outs = [torch.empty_like(i["x"][0]) for i in inp]
        cu = meta["cu_seqlens"]

        def tk_call(i):
            d = inp[i]
            return tk_backend.mamba_chunk_scan_varlen(d["x"][0], d["dt"][0], d["A"], d["B"][0], d["C"][0], cu,
                                                      chunk_size=chunk, D=d["D"], dt_bias=d["dt_bias"],
                                                      initial_states=states0[i], dt_softplus=True, out=outs[i])
        impls = {"tk": tk_call}
        if vllm is not None:
            def vllm_call(i):
                d = inp[i]
                return _call_by_name(vllm, x=d["x"][0], dt=d["dt"][0], A=d["A"], B=d["B"][0], C=d["C"][0],
                                     chunk_size=chunk, out=outs[i], D=d["D"], dt_bias=d["dt_bias"],
                                     initial_states=states0[i], dt_softplus=True, **meta)
            impls["vllm_triton"] = vllm_call
        for name, call in impls.items():
            try:
                ms = time_per_call(call, sets)
            except Exception as exc:  # noqa: BLE001 (a peer's API drift must not sink the family)
                print(f"mamba2_ssd: {name} failed on {case}: {type(exc).__name__}: {exc}")
                continue
            rows.append(Row("mamba2_ssd", case, name, ms, tbps=per_set / ms / 1e9))
        del inp, outs, states0
        torch.cuda.empty_cache()
    return rows
