"""Pure-PyTorch references for every op, computed in float32 (or float64) on upcast inputs.

They favour the plainest formulation over speed (per-sequence loops, sequential recurrences): they are the
ground truth the kernels are tested against, so each reads like the definition of its op.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


def gemm(a: torch.Tensor, b: torch.Tensor, trans_b: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bb = b.to(dtype)
    return a.to(dtype) @ (bb.T if trans_b else bb)


# ----------------------------------------------------------------------------------------------- attention


def visible_keys(
    lq: int, lk: int, causal: bool, window_size: tuple[int, int] = (-1, -1), device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[lq, lk] bool: which keys each query may attend, with flash-attn's bottom-right alignment.

    Query i sits at key position i + lk - lq (the last query aligns with the last key); it sees key j iff
    pos - left <= j <= pos + right, a bound of -1 meaning unbounded; causal means right = 0.
    """
    left, right = window_size
    if causal:
        right = 0
    pos = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    return ok


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # uint8: float8_e4m3fn bytes (vLLM's caches)


def dequantize_cache(x: torch.Tensor, descale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows [..., Hkv, D] in float32: FP8 ones (float8_e4m3fn, or uint8 holding its bytes) times their heads'
    descale [Hkv] (None: 1); 16-bit ones as they are."""
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    x = x.float()
    return x if descale is None else x * descale.float()[:, None]


def _gather(x: torch.Tensor, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x[index], through x's bytes for FP8 (indexing is not implemented for float8 on every device)."""
    if x.dtype == torch.float8_e4m3fn:
        return x.view(torch.uint8)[index].view(torch.float8_e4m3fn)
    return x[index]


def _sequence_keys(
    k: torch.Tensor, v: torch.Tensor, b: int, key_start: int, length: int, block_table: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [length, Hkv, D] of sequence b, from a varlen tensor or through its page table."""
    if block_table is None:
        return k[key_start : key_start + length], v[key_start : key_start + length]
    block_size = k.shape[1]
    t = torch.arange(length, device=k.device)
    pages = block_table[b].to(k.device).long()[t // block_size]
    return _gather(k, (pages, t % block_size)), _gather(v, (pages, t % block_size))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func in float32: returns out [total_q, Hq, D] and lse [Hq, total_q] (natural log).

    q is [total_q, Hq, D]; k/v are [total_k, Hkv, D], or paged caches [num_blocks, block_size, Hkv, D] (any
    strides) when block_table [batch, max_blocks] is given. Sequence b has cu_seqlens_q[b+1] - cu_seqlens_q[b]
    queries and seqused_k[b] keys if given, else cu_seqlens_k[b+1] - cu_seqlens_k[b]. Query head h reads kv
    head h // (Hq // Hkv). Scores are scaled, then soft-capped (softcap * tanh(s / softcap)) when softcap > 0.

    A query row that sees no key (causal with more queries than keys, or a window that excludes everything)
    gets out = 0 and lse = -inf: the log of an empty sum, which merges correctly with other partial results.
    (flash-attn itself reports +inf there.)

    sinks [Hq] (attention sinks, gpt-oss): one logit per query head that joins every row's softmax denominator and
    attends to nothing; lse then includes it (a row that sees no key: out 0, lse = its sink).

    FP8 caches (float8_e4m3fn or uint8 bytes of it) are dequantized first: sequence b reads k * k_descale[b, h] and
    v * v_descale[b, h], and its queries of kv head h are q * q_descale[b, h] (each [batch, Hkv], None: 1). So the
    attention runs on the dequantized cache exactly, in float32.
    """
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(total_q, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float32, device=q.device)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist() if cu_seqlens_k is not None else None
    for b in range(len(cu_q) - 1):
        q0, q1 = cu_q[b], cu_q[b + 1]
        key_start = cu_k[b] if cu_k is not None else 0
        lk = int(seqused_k[b]) if seqused_k is not None else cu_k[b + 1] - cu_k[b]
        kb, vb = _sequence_keys(k, v, b, key_start, lk, block_table)
        row = lambda t: None if t is None else t[b]  # noqa: E731
        kb = dequantize_cache(kb, row(k_descale)).repeat_interleave(hq // hkv, dim=1)
        vb = dequantize_cache(vb, row(v_descale)).repeat_interleave(hq // hkv, dim=1)
        qb = q[q0:q1].float()
        if q_descale is not None:
            qb = qb * q_descale[b].float().repeat_interleave(hq // hkv)[:, None]
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible_keys(q1 - q0, lk, causal, window_size, q.device), -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)
        if sinks is not None:
            row_lse = torch.logaddexp(row_lse, sinks.float()[:, None].expand_as(row_lse))
        # A finite floor keeps exp(s - lse) at 0 instead of NaN for rows that see no key.
        p = torch.exp(s - row_lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, vb)
        lse[:, q0:q1] = row_lse
    return out, lse


def _uniform_cu_seqlens(batch: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_func in float32: q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D] -> out [B, Nq, Hq, D], lse [B, Hq, Nq]."""
    bsz, nq, hq, _ = q.shape
    nk = k.shape[1]
    out, lse = attention(
        q.reshape(bsz * nq, hq, -1), k.reshape(bsz * nk, k.shape[2], -1), v.reshape(bsz * nk, v.shape[2], -1),
        _uniform_cu_seqlens(bsz, nq, q.device), _uniform_cu_seqlens(bsz, nk, q.device),
        softmax_scale, causal, window_size, softcap,
    )
    return out.view(bsz, nq, hq, -1), lse.view(hq, bsz, nq).transpose(0, 1)


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache on paged caches, in float32: out [B, q_len, Hq, D], lse [B, Hq, q_len].

    The q_len new tokens of sequence b are the last q_len of its cache_seqlens[b] cached tokens
    (bottom-right alignment), so with causal=True query t sees keys 0 .. cache_seqlens[b] - q_len + t.
    FP8 caches and their descales as in `attention`.
    """
    bsz, q_len, hq, _ = q.shape
    out, lse = attention(
        q.reshape(bsz * q_len, hq, -1), k_cache, v_cache, _uniform_cu_seqlens(bsz, q_len, q.device), None,
        softmax_scale, causal, window_size, softcap, block_table=block_table, seqused_k=cache_seqlens, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
    )
    return out.view(bsz, q_len, hq, -1), lse.view(hq, bsz, q_len).transpose(0, 1)


# ------------------------------------------------------------------------------------------ Mamba-2 SSD


def _groups_to_heads(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """B or C with one entry per group -> one per head: head h reads group h // (heads // groups)."""
    return t.float().repeat_interleave(heads // t.shape[dim], dim=dim)


def _per_head(t: torch.Tensor, headdim: int) -> torch.Tensor:
    """D (or dt_bias) given as [h] or [h, p] -> [h, p] float32."""
    t = t.float()
    return t[:, None].expand(-1, headdim) if t.dim() == 1 else t


def _effective_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float] | None
) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)  # like mamba_ssm: identity above 20, where softplus(x) == x in float32
    if dt_limit is not None:
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    return dt


def _scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence, one step at a time: x [b, l, h, p], dt [b, l, h], B/C [b, l, h, n], state [b, h, p, n]."""
    y = torch.empty_like(x)
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        inject = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = decay * state + inject
        y[:, t] = torch.einsum("bhpn,bhn->bhp", state, C[:, t])
    return y, state


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mamba_chunk_scan_combined's math as a sequential recurrence in float32: returns (y, final_states).

    x [b, l, h, p], dt [b, l, h], A [h], B/C [b, l, g, n] (head h uses group h // (h/g)), D [h] or [h, p],
    z [b, l, h, p], dt_bias [h]. Per head, with dt' = clamp(softplus?(dt + dt_bias), *dt_limit):
        state_t = exp(dt'_t A) state_{t-1} + dt'_t x_t B_t^T        (p x n)
        y_t     = (state_t C_t + D x_t) * silu(z_t)
    Like mamba_ssm the clamp always applies, so the default (0, inf) turns negative dt' into 0.
    final_states is [b, h, p, n]; with cu_seqlens (batch must be 1) every sequence starts from its own
    initial state ([num_seqs, h, p, n], zeros if None) and final_states is [num_seqs, h, p, n].
    """
    bsz, seqlen, heads, headdim = x.shape
    dstate = B.shape[-1]
    dt = _effective_dt(dt, dt_bias, dt_softplus, dt_limit)
    A, xf = A.float(), x.float()
    Bh, Ch = _groups_to_heads(B, heads, 2), _groups_to_heads(C, heads, 2)
    if cu_seqlens is None:
        zeros = x.new_zeros(bsz, heads, headdim, dstate, dtype=torch.float32)
        y, final = _scan(xf, dt, A, Bh, Ch, initial_states.float() if initial_states is not None else zeros)
    else:
        if bsz != 1:
            raise ValueError(f"x must have batch 1 when cu_seqlens is given, got {bsz}")
        bounds = cu_seqlens.tolist()
        y = torch.empty_like(xf)
        finals = []
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            state0 = (initial_states[s : s + 1].float() if initial_states is not None
                      else x.new_zeros(1, heads, headdim, dstate, dtype=torch.float32))
            part = slice(start, end)
            y[:, part], state = _scan(xf[:, part], dt[:, part], A, Bh[:, part], Ch[:, part], state0)
            finals.append(state[0])
        final = torch.stack(finals) if finals else x.new_zeros(0, heads, headdim, dstate, dtype=torch.float32)
    if D is not None:
        y = y + xf * _per_head(D, headdim)
    if z is not None:
        y = y * F.silu(z.float())
    return y, final


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
) -> torch.Tensor:
    """mamba_ssm's selective_state_update (multi-head form): one decode step; updates `state` in place.

    With state_batch_indices, batch row b reads and writes state row state_batch_indices[b] (vLLM's cache
    slots); rows whose index is pad_slot_id are skipped (their y is 0 here and their state untouched).

    state [batch, h, p, n], x [batch, h, p], dt [batch, h, p] or [batch, h], A [h, p, n] or [h],
    B/C [batch, g, n], D [h, p] or [h], z [batch, h, p], dt_bias [h, p] or [h]. Returns y [batch, h, p]
    in float32. As in mamba_ssm there is no dt clamp here (the chunked scan clamps to dt_limit); the two
    agree whenever dt' >= 0, e.g. with dt_softplus=True.
    """
    if state_batch_indices is not None:
        idx = state_batch_indices.long()
        keep = idx != pad_slot_id
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        rows = state[idx[keep]].clone()
        pick = lambda t: None if t is None else t[keep]  # noqa: E731
        y[keep] = selective_state_update(rows, x[keep], dt[keep], A, B[keep], C[keep], D, pick(z), dt_bias,
                                         dt_softplus)
        state[idx[keep]] = rows.to(state.dtype)
        return y
    heads, headdim = state.shape[1], state.shape[2]
    if dt.dim() == 2:
        dt = dt[:, :, None].expand(-1, -1, headdim)
    if dt_bias is not None:
        dt = dt.float() + _per_head(dt_bias, headdim)
    dt = _effective_dt(dt, None, dt_softplus, None)  # [batch, h, p]
    A = A.float()
    if A.dim() == 1:
        A = A[:, None, None]
    Bh, Ch = _groups_to_heads(B, heads, 1), _groups_to_heads(C, heads, 1)
    xf = x.float()
    new_state = torch.exp(dt[..., None] * A) * state.float() + (dt * xf)[..., None] * Bh[:, :, None, :]
    state.copy_(new_state)
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + xf * _per_head(D, headdim)
    if z is not None:
        y = y * F.silu(z.float())
    return y


# ------------------------------------------------------------------------------------------------ Based
#
# Based (FLA's parallel_based): causal linear attention whose kernel is the 2nd-order Taylor expansion of exp,
#   w(q, k) = 1 + s + s^2 / 2  with s = scale * q.k  (scale defaults to Dk^-0.5, applied to q only),
#   o_i = sum_{j<=i} w(q_i, k_j) v_j  /  (sum_{j<=i} w(q_i, k_j) + eps)   (the division only if use_norm).
# w factors through the feature map phi(x) = [1, x, (x (x) x) / sqrt(2)], so the recurrent state is the three
# moments of keys against values. Values are augmented with a column of ones so that the same moments also
# carry the normaliser sum_j w(q_i, k_j).


class BasedState(NamedTuple):
    """Moments over the keys seen so far, against values with a trailing ones column (Dv + 1 wide)."""

    zeroth: torch.Tensor  # [B, H, Dv + 1]          sum_j v_j
    first: torch.Tensor  # [B, H, Dk, Dv + 1]       sum_j k_j (x) v_j
    second: torch.Tensor  # [B, H, Dk, Dk, Dv + 1]  sum_j k_j (x) k_j (x) v_j


def based(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    use_norm: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """FLA's parallel_based in float32: q/k [B, N, H, Dk] (Dk = 16 in Based), v [B, N, H, Dv] -> [B, N, H, Dv]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q.float() * scale, k.float())
    n = q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    w = (1 + s + 0.5 * s * s).masked_fill(~causal, 0.0)
    o = torch.einsum("bhij,bjhd->bihd", w, v.float())
    if use_norm:
        o = o / (w.sum(-1).transpose(1, 2)[..., None] + eps)
    return o


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    return torch.cat([v.float(), v.new_ones(*v.shape[:-1], 1, dtype=torch.float32)], dim=-1)


def based_prefill_state(k: torch.Tensor, v: torch.Tensor) -> BasedState:
    """The state after consuming k [B, N, H, Dk], v [B, N, H, Dv] (N may be 0: the empty state)."""
    kf, va = k.float(), _with_ones(v)
    return BasedState(
        zeroth=va.sum(1),
        first=torch.einsum("bnhk,bnhv->bhkv", kf, va),
        second=torch.einsum("bnhk,bnhl,bnhv->bhklv", kf, kf, va),
    )


def based_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: BasedState,
    scale: float | None = None,
    use_norm: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, BasedState]:
    """One decode step: q/k [B, H, Dk], v [B, H, Dv]. Adds the token to the state, then reads it out.

    Returns (o [B, H, Dv], new state); the input state is left unchanged.
    """
    kf, va = k.float(), _with_ones(v)
    state = BasedState(
        zeroth=state.zeroth + va,
        first=state.first + torch.einsum("bhk,bhv->bhkv", kf, va),
        second=state.second + torch.einsum("bhk,bhl,bhv->bhklv", kf, kf, va),
    )
    qs = q.float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    o = (
        state.zeroth
        + torch.einsum("bhk,bhkv->bhv", qs, state.first)
        + 0.5 * torch.einsum("bhk,bhl,bhklv->bhv", qs, qs, state.second)
    )
    num, den = o[..., :-1], o[..., -1:]
    return (num / (den + eps) if use_norm else num), state
