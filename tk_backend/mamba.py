"""Mamba-2 SSD with mamba_ssm's API: the chunked scan (dense and varlen prefill) and the decode state update.

x / B / C / z are bfloat16 or float16; dt, A, dt_bias, D and the states are used in float32 (other float
dtypes are converted). headdim 64 or 128, dstate 64, 128 or 256, nheads a multiple of ngroups.

Varlen (cu_seqlens given, batch 1): every sequence is scanned on its own from its own initial state
(initial_states [num_seqs, nheads, headdim, dstate], zeros if None), so chunks never straddle sequences
and seq_idx is not needed (it is accepted and ignored). Unlike mamba_ssm, `final_states` is then per
sequence ([num_seqs, ...], the same tensor as `varlen_states`) rather than the state at the end of the
packed batch. The result does not depend on chunk_size (exact arithmetic regrouped): it is validated and
the kernel always works in 64-token chunks.

Everything is graph-capturable: validation reads shapes, dtypes and strides only.
"""
from __future__ import annotations

import math

import torch

from tk_backend import _checks
from tk_backend._library import lib, require_kernels

HEAD_DIMS = (64, 128)
STATE_DIMS = (64, 128, 256)

lib.define(
    "ssd_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
    "Tensor? initial_states, Tensor? cu_seqlens, bool dt_softplus, float dt_min, float dt_max, "
    "Tensor(a!) out, Tensor(b!)? final_states) -> ()"
)
lib.define(
    "ssd_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
    "Tensor? dt_bias, bool dt_softplus, Tensor? state_batch_indices, int pad_slot_id, Tensor(b!) out) -> ()"
)


@torch.library.register_fake("tk::ssd_scan")
def _ssd_scan_fake(*args) -> None:
    return None


@torch.library.register_fake("tk::ssd_update")
def _ssd_update_fake(*args) -> None:
    return None


# ------------------------------------------------------------------------------------------- validation


def _float_tensor(t: object, name: str) -> torch.Tensor:
    t = _checks.tensor(t, name)
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {str(t.dtype).replace('torch.', '')}")
    return t


def _addressable(t: torch.Tensor, name: str) -> None:
    if not _checks.tma_ready(t):
        raise ValueError(
            f"{name} must have a contiguous last dimension and 16-byte aligned base and strides, got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}"
        )


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t as float32, its broadcast (stride-0) dims kept: vLLM's mixer passes dt as a 16-bit [batch, nheads] view
    expanded over headdim, and a plain .float() would write it out whole, which also hides the per-head form from
    the update kernel (it reads the strides)."""
    if t.dtype == torch.float32:
        return t
    if t.numel() > 1 and 0 in t.stride():
        compact = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]
        return compact.float().expand(t.shape)
    return t.float()


def _dt_limit(dt_limit: object) -> tuple[float, float]:
    if not (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in dt_limit)):
        raise TypeError(f"dt_limit must be a (min, max) pair of floats, got {dt_limit!r}")
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must satisfy min <= max, got {dt_limit!r}")
    return lo, hi


def _per_head(t: object, name: str, heads: int, headdim: int, ref: torch.Tensor) -> torch.Tensor | None:
    """D / dt_bias given as [nheads] or [nheads, headdim] -> float32 [nheads, headdim] (a broadcast view)."""
    if t is None:
        return None
    t = _float_tensor(t, name)
    _checks.same_device(t, ref, name, "x")
    if tuple(t.shape) == (heads,):
        return _f32(t)[:, None].expand(heads, headdim)
    if tuple(t.shape) == (heads, headdim):
        return _f32(t)
    raise ValueError(f"{name} must have shape ({heads},) or ({heads}, {headdim}), got {tuple(t.shape)}")


def _check_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
                return_varlen_states):
    x = _checks.tensor(x, "x", dtypes=_checks.HALF_TYPES, ndim=4)
    batch, seqlen, heads, headdim = x.shape
    if headdim not in HEAD_DIMS:
        raise ValueError(f"headdim (x.shape[3]) must be 64 or 128, got {headdim}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dt = _float_tensor(dt, "dt")
    _checks.same_device(dt, x, "dt", "x")
    _checks.shape(dt, "dt", (batch, seqlen, heads))
    A = _float_tensor(A, "A")
    _checks.same_device(A, x, "A", "x")
    _checks.shape(A, "A", (heads,))
    B = _checks.tensor(B, "B", ndim=4)
    C = _checks.tensor(C, "C", ndim=4)
    for t, name in ((B, "B"), (C, "C")):
        _checks.same_dtype(t, x, name, "x")
        _checks.same_device(t, x, name, "x")
    groups, dstate = B.shape[2], B.shape[3]
    _checks.shape(B, "B", (batch, seqlen, groups, dstate))
    _checks.shape(C, "C", tuple(B.shape))
    if dstate not in STATE_DIMS:
        raise ValueError(f"dstate (B.shape[3]) must be 64, 128 or 256, got {dstate}")
    if groups < 1 or heads % groups:
        raise ValueError(f"nheads ({heads}) must be a multiple of ngroups (B.shape[2] = {groups})")
    D = _per_head(D, "D", heads, headdim, x)
    dt_bias = _per_head(dt_bias, "dt_bias", heads, headdim, x)
    if dt_bias is not None and dt_bias.stride(1) != 0:
        raise ValueError("dt_bias must be per head ([nheads]) for the chunked scan")
    if z is not None:
        z = _checks.tensor(z, "z")
        _checks.same_dtype(z, x, "z", "x")
        _checks.same_device(z, x, "z", "x")
        _checks.shape(z, "z", tuple(x.shape))
        if z.stride(-1) != 1:
            raise ValueError(f"z must have a contiguous last dimension, got strides {tuple(z.stride())}")
    if cu_seqlens is not None:
        cu_seqlens = _checks.tensor(cu_seqlens, "cu_seqlens", dtypes=(torch.int32, torch.int64), ndim=1)
        _checks.same_device(cu_seqlens, x, "cu_seqlens", "x")
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens must have num_seqs + 1 >= 1 entries")
        if batch != 1:
            raise ValueError(f"x must have batch 1 when cu_seqlens is given, got {batch}")
        num_seqs = cu_seqlens.shape[0] - 1
    else:
        if seq_idx is not None:
            raise ValueError("seq_idx without cu_seqlens is not supported: pass cu_seqlens (sequence starts)")
        if return_varlen_states:
            raise ValueError("return_varlen_states needs cu_seqlens")
        num_seqs = batch
    if seq_idx is not None:
        seq_idx = _checks.tensor(seq_idx, "seq_idx", dtypes=(torch.int32, torch.int64))
        _checks.shape(seq_idx, "seq_idx", (batch, seqlen))
    if initial_states is not None:
        initial_states = _float_tensor(initial_states, "initial_states")
        _checks.same_device(initial_states, x, "initial_states", "x")
        _checks.shape(initial_states, "initial_states", (num_seqs, heads, headdim, dstate))
        initial_states = _f32(initial_states)
        if initial_states.stride(-1) != 1:
            initial_states = initial_states.contiguous()
    lo, hi = _dt_limit(dt_limit)
    for t, name in ((x, "x"), (B, "B"), (C, "C")):
        _addressable(t, name)
    return x, _f32(dt), _f32(A).contiguous(), B, C, D, z, dt_bias, initial_states, cu_seqlens, num_seqs, lo, hi


# ------------------------------------------------------------------------------------------------ scan


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    *,
    out: torch.Tensor | None = None,
):
    """mamba_ssm's mamba_chunk_scan_combined (forward). x [batch, seqlen, nheads, headdim], dt [batch, seqlen,
    nheads], A [nheads], B / C [batch, seqlen, ngroups, dstate], D [nheads] or [nheads, headdim], z like x,
    dt_bias [nheads]. Returns out (x's dtype), then final_states and varlen_states (float32) when asked."""
    (x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens, num_seqs, lo, hi) = _check_scan(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
        return_varlen_states)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _checks.tensor(out, "out")
        _checks.same_dtype(out, x, "out", "x")
        _checks.same_device(out, x, "out", "x")
        _checks.shape(out, "out", tuple(x.shape))
        _addressable(out, "out")
    want_states = return_final_states or return_varlen_states
    states = (x.new_empty(num_seqs, x.shape[2], x.shape[3], B.shape[3], dtype=torch.float32)
              if want_states else None)
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    if cu_seqlens is not None and not cu_seqlens.is_contiguous():
        cu_seqlens = cu_seqlens.contiguous()
    require_kernels(x)
    torch.ops.tk.ssd_scan(x, dt, A, B, C, D, z, dt_bias[:, 0].contiguous() if dt_bias is not None else None,
                          initial_states, cu_seqlens, bool(dt_softplus), lo, hi, out, states)
    if not want_states:
        return out
    if not return_varlen_states:
        return out, states
    return (out, states, states) if return_final_states else (out, states)


def mamba_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed form vLLM's MambaMixer2 uses: x [tokens, nheads, headdim], dt [tokens, nheads], B / C
    [tokens, ngroups, dstate], cu_seqlens [num_seqs + 1], initial_states [num_seqs, nheads, headdim, dstate]
    or None. Writes out ([tokens, nheads, headdim], allocated if None) and returns (out, final_states) with
    final_states float32 [num_seqs, nheads, headdim, dstate]."""
    for t, name, ndim in ((x, "x", 3), (dt, "dt", 2), (B, "B", 3), (C, "C", 3)):
        _checks.tensor(t, name, ndim=ndim)
    if z is not None:
        _checks.tensor(z, "z", ndim=3)
    if out is not None:
        _checks.tensor(out, "out", ndim=3)
    y, states = mamba_chunk_scan_combined(
        x[None], dt[None], A, B[None], C[None], chunk_size, D=D, z=None if z is None else z[None], dt_bias=dt_bias,
        initial_states=initial_states, cu_seqlens=cu_seqlens, dt_softplus=dt_softplus, dt_limit=dt_limit,
        return_varlen_states=True, out=None if out is None else out[None])
    return y[0], states


# ---------------------------------------------------------------------------------------------- decode


def _broadcast(t: object, name: str, shapes: dict[tuple[int, ...], callable], ref: torch.Tensor) -> torch.Tensor:
    t = _float_tensor(t, name)
    _checks.same_device(t, ref, name, "x")
    for shape, expand in shapes.items():
        if tuple(t.shape) == shape:
            return expand(_f32(t))
    allowed = " or ".join(str(s) for s in shapes)
    raise ValueError(f"{name} must have shape {allowed}, got {tuple(t.shape)}")


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """mamba_ssm's selective_state_update: one decode step, `state` updated in place; returns out (x's dtype).

    state [num_states, nheads, headdim, dstate] (float32 or x's dtype), x [batch, nheads, headdim],
    dt [batch, nheads, headdim] or [batch, nheads], A [nheads, headdim, dstate] or [nheads],
    B / C [batch, ngroups, dstate], D / dt_bias [nheads, headdim] or [nheads], z like x. The single-head
    forms of mamba_ssm (x [batch, headdim], ...) are accepted too. Batch row b uses state row
    state_batch_indices[b] (b if None); rows whose index equals pad_slot_id are skipped (vLLM's padding).
    """
    x = _checks.tensor(x, "x", dtypes=_checks.HALF_TYPES)
    if x.dim() == 2:  # mamba_ssm's single-head form
        squeeze = True
        x = x[:, None]
        dt = _checks.tensor(dt, "dt")[:, None]
        A = _checks.tensor(A, "A")[None]
        B = _checks.tensor(B, "B")[:, None]
        C = _checks.tensor(C, "C")[:, None]
        D = None if D is None else _checks.tensor(D, "D")[None]
        z = None if z is None else _checks.tensor(z, "z")[:, None]
        dt_bias = None if dt_bias is None else _checks.tensor(dt_bias, "dt_bias")[None]
        state = _checks.tensor(state, "state")[:, None]
        out = None if out is None else _checks.tensor(out, "out")[:, None]
    else:
        squeeze = False
    if x.dim() != 3:
        raise ValueError(f"x must be [batch, nheads, headdim], got shape {tuple(x.shape)}")
    batch, heads, headdim = x.shape
    state = _checks.tensor(state, "state", ndim=4)
    _checks.same_device(state, x, "state", "x")
    if state.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"state must be float32 or x's dtype {x.dtype}, got {state.dtype}")
    B = _checks.tensor(B, "B", ndim=3)
    C = _checks.tensor(C, "C", ndim=3)
    for t, name in ((B, "B"), (C, "C")):
        _checks.same_dtype(t, x, name, "x")
        _checks.same_device(t, x, name, "x")
    groups, dstate = B.shape[1], B.shape[2]
    _checks.shape(B, "B", (batch, groups, dstate))
    _checks.shape(C, "C", (batch, groups, dstate))
    if groups < 1 or heads % groups:
        raise ValueError(f"nheads ({heads}) must be a multiple of ngroups (B.shape[1] = {groups})")
    if tuple(state.shape[1:]) != (heads, headdim, dstate):
        raise ValueError(f"state must be [num_states, {heads}, {headdim}, {dstate}], got {tuple(state.shape)}")
    dt = _broadcast(dt, "dt", {(batch, heads, headdim): lambda t: t,
                               (batch, heads): lambda t: t[:, :, None].expand(batch, heads, headdim)}, x)
    A = _broadcast(A, "A", {(heads, headdim, dstate): lambda t: t,
                            (heads,): lambda t: t[:, None, None].expand(heads, headdim, dstate)}, x)
    per_head = {(heads, headdim): lambda t: t, (heads,): lambda t: t[:, None].expand(heads, headdim)}
    D = None if D is None else _broadcast(D, "D", per_head, x)
    dt_bias = None if dt_bias is None else _broadcast(dt_bias, "dt_bias", per_head, x)
    if z is not None:
        z = _checks.tensor(z, "z")
        _checks.same_dtype(z, x, "z", "x")
        _checks.same_device(z, x, "z", "x")
        _checks.shape(z, "z", tuple(x.shape))
    if state_batch_indices is not None:
        state_batch_indices = _checks.tensor(state_batch_indices, "state_batch_indices",
                                             dtypes=(torch.int32, torch.int64), ndim=1)
        _checks.same_device(state_batch_indices, x, "state_batch_indices", "x")
        _checks.shape(state_batch_indices, "state_batch_indices", (batch,))
        state_batch_indices = state_batch_indices.to(torch.int32).contiguous()
    elif state.shape[0] != batch:
        raise ValueError(f"state must have {batch} rows (x's batch) without state_batch_indices, got {state.shape[0]}")
    for t, name in ((state, "state"), (x, "x"), (B, "B"), (C, "C"), (z, "z")):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _checks.same_dtype(out, x, "out", "x")
        _checks.same_device(out, x, "out", "x")
        _checks.shape(out, "out", tuple(x.shape))
        if out.stride(-1) != 1:
            raise ValueError("out must have a contiguous last dimension")
    require_kernels(x)
    torch.ops.tk.ssd_update(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), state_batch_indices,
                            int(pad_slot_id), out)
    return out[:, 0] if squeeze else out
