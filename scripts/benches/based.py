"""Based family: tk vs fla-core 0.6.0's parallel_based and fused_chunk_based (prefill), and the decode step
against the measured copy bandwidth (no peer has a Based step kernel).

Prefill rows carry median ms only (tk/best is then the speed-up over the fastest FLA kernel); the step row
carries tbps of its state traffic (the fp32 state read and written once), next to a device copy of as many
bytes. Every impl is timed by CUDA-graph replay on the same inputs.
"""
from __future__ import annotations

import torch

from benchlib import Row, copies_to_defeat_l2, selected, time_per_call
from tk_backend import based

B, H, DK, DV = 16, 16, 16, 64
PREFILL_N = (1024, 4096, 16384)
STEP_BATCH = 256


def _fla():
    try:
        from fla.ops.based import fused_chunk_based, parallel_based
    except Exception as exc:  # noqa: BLE001  (missing package, or one of its imports)
        print(f"  based: fla impls skipped (fla-core not importable: {type(exc).__name__}: {str(exc)[:120]})")
        return {}
    return {"fla_parallel": parallel_based, "fla_fused_chunk": fused_chunk_based}


def _time(case: str, impls: dict, sets: int, **metric) -> list[Row]:
    rows = []
    for impl, call in selected(impls).items():
        try:
            ms = time_per_call(call, sets)
        except Exception as exc:  # noqa: BLE001
            print(f"  {case}: {impl} skipped ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
            continue
        extra = {k: f(ms) for k, f in metric.items()}
        rows.append(Row("based", case, impl, ms, **extra))
    return rows


def _prefill(n: int, fla: dict) -> list[Row]:
    bytes_per_set = B * n * H * (2 * DK + DV) * 2
    sets = copies_to_defeat_l2(bytes_per_set)
    inputs = [
        tuple(torch.randn(B, n, H, d, device="cuda", dtype=torch.bfloat16) for d in (DK, DK, DV)) for _ in range(sets)
    ]
    case = f"b{B}_h{H}_n{n}_f{DK}_d{DV}"
    impls = {"tk": lambda i: based.parallel_based(*inputs[i])}
    for name, fn in fla.items():
        impls[name] = lambda i, fn=fn: fn(*inputs[i])
    rows = _time(case, impls, sets)
    del inputs
    return rows


def _step() -> list[Row]:
    b = STEP_BATCH
    q, k = (torch.randn(b, H, DK, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, H, DV, device="cuda", dtype=torch.bfloat16)
    state = based.empty_state(b, H, DV, "cuda")
    for t in state:
        t.normal_()
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    moved = 2 * state_bytes + 2 * (q.numel() + k.numel() + 2 * v.numel())
    src = torch.empty(state_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    case = f"step_b{b}_h{H}_f{DK}_d{DV}"
    impls = {
        "tk": lambda i: based.based_step(q, k, v, state, inplace=True),
        "copy": lambda i: dst.copy_(src),  # the physical limit: as many bytes read and written
    }
    return _time(case, impls, 1, tbps=lambda ms: moved / ms / 1e9)


def run(quick: bool = False) -> list[Row]:
    fla = _fla()
    rows = []
    for n in PREFILL_N[:1] if quick else PREFILL_N:
        rows += _prefill(n, fla)
        torch.cuda.empty_cache()
    rows += _step()
    return rows
