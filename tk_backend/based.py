"""Based linear attention (arXiv 2402.18668): FLA's `parallel_based` / `fused_chunk_based`, with state hand-off.

Semantics are those of fla-core 0.6.0 (`fla.ops.based`): q, k [B, N, H, 16], v [B, N, H, Dv], causal linear
attention whose kernel is the 2nd-order Taylor expansion of exp, w = 1 + s + s^2 / 2 with s = scale * q.k
(scale defaults to 16 ** -0.5 and applies to q), outputs normalised by sum_j w + 1e-6 when use_norm, returned
in q's dtype. FLA computes the same function with two kernels; both names run ours.

Beyond FLA: `initial_state` / `output_final_state` carry the recurrent state (`BasedState`, float32 moments of
the keys against the values and a ones column), and `based_step` decodes one token against it, so a prefill
followed by steps equals one long prefill.
"""
from __future__ import annotations

import math

import torch

from tk_backend import _checks
from tk_backend._library import lib, require_kernels
from tk_backend.reference import BasedState

FEATURE_DIM = 16
VALUE_DIMS = (64, 128, 192, 256)
EPS = 1e-6  # fla-core 0.6.0's normaliser epsilon

lib.define(
    "based_prefill(Tensor q, Tensor k, Tensor v, float scale, bool use_norm, float eps, Tensor? initial_zeroth, "
    "Tensor? initial_first, Tensor? initial_second, Tensor(a!)? final_zeroth, Tensor(b!)? final_first, "
    "Tensor(c!)? final_second) -> Tensor"
)
lib.define(
    "based_step(Tensor q, Tensor k, Tensor v, Tensor(a!) zeroth, Tensor(b!) first, Tensor(c!) second, float scale, "
    "bool use_norm, float eps) -> Tensor"
)


@torch.library.register_fake("tk::based_prefill")
def _based_prefill_fake(q, k, v, *args) -> torch.Tensor:
    return q.new_empty((*q.shape[:3], v.shape[-1]))


@torch.library.register_fake("tk::based_step")
def _based_step_fake(q, k, v, *args) -> torch.Tensor:
    return q.new_empty((*q.shape[:2], v.shape[-1]))


__all__ = ["BasedState", "based_step", "empty_state", "fused_chunk_based", "parallel_based"]


def empty_state(batch: int, heads: int, head_dim_v: int, device: torch.device | str) -> BasedState:
    """The state before any token: zero moments, float32, in the layout the kernels read and write."""
    w = head_dim_v + 1
    return BasedState(
        zeroth=torch.zeros(batch, heads, w, device=device),
        first=torch.zeros(batch, heads, FEATURE_DIM, w, device=device),
        second=torch.zeros(batch, heads, FEATURE_DIM, FEATURE_DIM, w, device=device),
    )


def _scale(scale: object) -> float:
    if scale is None:
        return FEATURE_DIM**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    return float(scale)


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _feature_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.shape[-1] != FEATURE_DIM:
        raise ValueError(f"q must have feature dim {FEATURE_DIM} (Based's Taylor map), got {q.shape[-1]}")
    if k.shape[-1] != FEATURE_DIM:
        raise ValueError(f"k must have feature dim {FEATURE_DIM} (Based's Taylor map), got {k.shape[-1]}")
    if v.shape[-1] not in VALUE_DIMS:
        raise ValueError(f"v head dim must be one of {VALUE_DIMS}, got {v.shape[-1]}")


def _state(state: object, name: str, q: torch.Tensor, batch: int, heads: int, head_dim_v: int) -> BasedState:
    if not isinstance(state, tuple) or len(state) != 3:
        raise TypeError(f"{name} must be a BasedState (zeroth, first, second), got {type(state).__name__}")
    state = BasedState(*state)
    w = head_dim_v + 1
    shapes = {
        "zeroth": (batch, heads, w),
        "first": (batch, heads, FEATURE_DIM, w),
        "second": (batch, heads, FEATURE_DIM, FEATURE_DIM, w),
    }
    for field, shape in shapes.items():
        t = _checks.tensor(getattr(state, field), f"{name}.{field}", dtypes=(torch.float32,))
        _checks.same_device(t, q, f"{name}.{field}", "q")
        _checks.shape(t, f"{name}.{field}", shape)
    return state


def validate_prefill(q, k, v, scale, use_norm, initial_state, output_final_state) -> float:
    q = _checks.tensor(q, "q", dtypes=_checks.HALF_TYPES, ndim=4)
    k = _checks.tensor(k, "k", dtypes=_checks.HALF_TYPES, ndim=4)
    v = _checks.tensor(v, "v", dtypes=_checks.HALF_TYPES, ndim=4)
    _checks.same_dtype(k, q, "k", "q")
    _checks.same_dtype(v, q, "v", "q")
    _checks.same_device(k, q, "k", "q")
    _checks.same_device(v, q, "v", "q")
    _feature_dims(q, k, v)
    _checks.shape(k, "k", tuple(q.shape))
    b, n, h, _ = q.shape
    _checks.shape(v, "v", (b, n, h, v.shape[-1]))
    _bool(use_norm, "use_norm")
    _bool(output_final_state, "output_final_state")
    if initial_state is not None:
        _state(initial_state, "initial_state", q, b, h, v.shape[-1])
    return _scale(scale)


def validate_step(q, k, v, state, scale, use_norm) -> float:
    q = _checks.tensor(q, "q", dtypes=_checks.HALF_TYPES, ndim=3)
    k = _checks.tensor(k, "k", dtypes=_checks.HALF_TYPES, ndim=3)
    v = _checks.tensor(v, "v", dtypes=_checks.HALF_TYPES, ndim=3)
    _checks.same_dtype(k, q, "k", "q")
    _checks.same_dtype(v, q, "v", "q")
    _checks.same_device(k, q, "k", "q")
    _checks.same_device(v, q, "v", "q")
    _feature_dims(q, k, v)
    _checks.shape(k, "k", tuple(q.shape))
    b, h, _ = q.shape
    _checks.shape(v, "v", (b, h, v.shape[-1]))
    _bool(use_norm, "use_norm")
    _state(state, "state", q, b, h, v.shape[-1])
    return _scale(scale)


def _rows_ready(t: torch.Tensor) -> torch.Tensor:
    return t if _checks.tma_ready(t) else t.contiguous()


def parallel_based(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    use_norm: bool = True,
    *,
    initial_state: BasedState | None = None,
    output_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, BasedState]:
    """Causal Based attention: q, k [B, N, H, 16], v [B, N, H, Dv] -> o [B, N, H, Dv] in q's dtype.

    With `output_final_state` returns (o, state), the state after the last token (continuing from
    `initial_state` when given), ready for `based_step` or a later prefill.
    """
    scale = validate_prefill(q, k, v, scale, use_norm, initial_state, output_final_state)
    require_kernels(q)
    b, n, h, _ = q.shape
    dv = v.shape[-1]
    final = empty_state(b, h, dv, q.device) if output_final_state else None
    if n == 0:
        o = q.new_empty((b, 0, h, dv))
        if final is not None and initial_state is not None:
            for dst, src in zip(final, initial_state):
                dst.copy_(src)
        return (o, final) if output_final_state else o
    init = None if initial_state is None else BasedState(*(t.contiguous() for t in initial_state))
    o = torch.ops.tk.based_prefill(
        _rows_ready(q), _rows_ready(k), _rows_ready(v), scale, use_norm, EPS,
        *(init if init is not None else (None, None, None)),
        *(final if final is not None else (None, None, None)),
    )
    return (o, final) if output_final_state else o


def fused_chunk_based(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    use_norm: bool = True,
    *,
    initial_state: BasedState | None = None,
    output_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, BasedState]:
    """FLA's `fused_chunk_based`: the same function as `parallel_based` (one chunked kernel serves both)."""
    return parallel_based(q, k, v, scale, use_norm, initial_state=initial_state, output_final_state=output_final_state)


def based_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: BasedState,
    scale: float | None = None,
    use_norm: bool = True,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, BasedState]:
    """One decode token: q, k [B, H, 16], v [B, H, Dv]. Adds the token to the state, then reads it out.

    Returns (o [B, H, Dv] in q's dtype, new state). With `inplace` the state's tensors are updated where they
    are (each read and written once: the serving path); otherwise the input state is left unchanged.
    """
    scale = validate_step(q, k, v, state, scale, use_norm)
    _bool(inplace, "inplace")
    require_kernels(q)
    state = BasedState(*state)
    if inplace:
        for field, t in zip(state._fields, state):
            if not t.is_contiguous():
                raise ValueError(f"state.{field} must be contiguous to be updated in place")
    else:
        state = BasedState(*(t.clone(memory_format=torch.contiguous_format) for t in state))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = torch.ops.tk.based_step(q, k, v, *state, scale, use_norm, EPS)
    return o, state
