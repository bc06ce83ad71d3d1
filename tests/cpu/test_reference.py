"""The references against independent float64 formulations on tiny random shapes: loops, matrix forms, recurrences."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from tk_backend import reference
from tests.accuracy import assert_close

# ------------------------------------------------------------------------------------------- attention


def naive_attention(q, keys, values, lengths_q, scale, causal, window, softcap):
    """Per (sequence, head, query) python loops in float64; keys/values: one [Lk, Hkv, D] tensor per sequence."""
    total_q, hq, d = q.shape
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float64)
    left, right = window
    row = 0
    for lq, kb, vb in zip(lengths_q, keys, values):
        lk, hkv = kb.shape[0], kb.shape[1]
        for i in range(lq):
            pos = i + lk - lq
            seen = [j for j in range(lk)
                    if not (causal and j > pos) and not (left >= 0 and j < pos - left) and not (right >= 0 and j > pos + right)]
            for h in range(hq):
                kv_head = h // (hq // hkv)
                scores = []
                for j in seen:
                    s = float((q[row + i, h].double() * kb[j, kv_head].double()).sum()) * scale
                    scores.append(softcap * math.tanh(s / softcap) if softcap > 0 else s)
                if not scores:
                    continue
                m = max(scores)
                z = sum(math.exp(s - m) for s in scores)
                lse[h, row + i] = m + math.log(z)
                for j, s in zip(seen, scores):
                    out[row + i, h] += math.exp(s - m) / z * vb[j, kv_head].double()
        row += lq
    return out, lse


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _compare_attention(out, lse, ref_out, ref_lse, what):
    assert_close(out, ref_out, rel=1e-5, atol=1e-5, what=f"{what} out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse -inf pattern differs"
    assert (lse[~finite] == -math.inf).all(), f"{what}: empty rows must have lse -inf"
    assert_close(lse[finite], ref_lse[finite], rel=1e-5, atol=1e-5, what=f"{what} lse")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (2, 1), (3, 0), (0, 0), (-1, 2)])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (3, 1)])
def test_varlen_attention_matches_loops(causal, window, softcap, hq, hkv, seed):
    rng = random.Random(seed)
    d = 8
    lengths_q = [rng.randint(1, 6) for _ in range(3)]
    lengths_k = [lq + rng.randint(0, 4) for lq in lengths_q]
    q = torch.randn(sum(lengths_q), hq, d)
    k = torch.randn(sum(lengths_k), hkv, d)
    v = torch.randn(sum(lengths_k), hkv, d)
    scale = 0.7
    out, lse = reference.attention(q, k, v, _cu(lengths_q), _cu(lengths_k), scale, causal, window, softcap)
    keys = list(torch.split(k, lengths_k))
    values = list(torch.split(v, lengths_k))
    ref_out, ref_lse = naive_attention(q, keys, values, lengths_q, scale, causal, window, softcap)
    _compare_attention(out, lse, ref_out, ref_lse, f"causal={causal} window={window} softcap={softcap} seed={seed}")


def test_rows_without_visible_keys_are_zero_with_lse_minus_inf(seed):
    # 5 queries, 2 keys, causal bottom-right: queries 0..2 sit before the first key.
    q, k, v = torch.randn(5, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    out, lse = reference.attention(q, k, v, _cu([5]), _cu([2]), None, True)
    assert (out[:3] == 0).all() and (lse[:, :3] == -math.inf).all()
    assert torch.isfinite(lse[:, 3:]).all() and not torch.isnan(out).any()
    ref_out, ref_lse = naive_attention(q, [k], [v], [5], 8**-0.5, True, (-1, -1), 0.0)
    _compare_attention(out, lse, ref_out, ref_lse, "empty rows")


def _paged(keys_per_seq, block_size, hkv, d, combined):
    """Scatter per-sequence keys/values into a shuffled paged cache; unused table columns hold garbage ids."""
    pages = [math.ceil(len(kb) / block_size) for kb, _ in keys_per_seq]
    num_blocks = sum(pages) + 3
    if combined:  # vLLM-style one cache holding K | V along the last dim
        kv = torch.randn(num_blocks, block_size, hkv, 2 * d)
        k_cache, v_cache = kv[..., :d], kv[..., d:]
    else:
        k_cache, v_cache = torch.randn(num_blocks, block_size, hkv, d), torch.randn(num_blocks, block_size, hkv, d)
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(pages), max(pages) + 2), 10**6, dtype=torch.int32)
    table[:, -1] = -5
    for b, (kb, vb) in enumerate(keys_per_seq):
        for p in range(pages[b]):
            block = order.pop()
            table[b, p] = block
            n = min(block_size, len(kb) - p * block_size)
            k_cache[block, :n] = kb[p * block_size : p * block_size + n]
            v_cache[block, :n] = vb[p * block_size : p * block_size + n]
    return k_cache, v_cache, table


@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_attention_matches_loops(combined, causal, seed):
    rng = random.Random(seed)
    hq, hkv, d, block_size = 4, 2, 8, 4
    lengths_q = [rng.randint(1, 5) for _ in range(3)]
    lengths_k = [lq + rng.randint(0, 9) for lq in lengths_q]
    kv = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lengths_k]
    k_cache, v_cache, table = _paged(kv, block_size, hkv, d, combined)
    q = torch.randn(sum(lengths_q), hq, d)
    seqused = torch.tensor(lengths_k, dtype=torch.int32)
    window = (rng.choice([-1, 3]), -1)
    out, lse = reference.attention(q, k_cache, v_cache, _cu(lengths_q), None, None, causal, window, 0.0,
                                   block_table=table, seqused_k=seqused)
    ref_out, ref_lse = naive_attention(q, [kb for kb, _ in kv], [vb for _, vb in kv], lengths_q, d**-0.5, causal, window, 0.0)
    _compare_attention(out, lse, ref_out, ref_lse, f"paged combined={combined} causal={causal} seed={seed}")


def test_seqused_k_limits_varlen_keys(seed):
    q, k, v = torch.randn(3, 2, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    used = torch.tensor([4], dtype=torch.int32)
    out, lse = reference.attention(q, k, v, _cu([3]), _cu([10]), None, True, seqused_k=used)
    ref_out, ref_lse = naive_attention(q, [k[:4]], [v[:4]], [3], 8**-0.5, True, (-1, -1), 0.0)
    _compare_attention(out, lse, ref_out, ref_lse, "seqused_k")


def test_dense_wraps_varlen(seed):
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    out, lse = reference.attention_dense(q, k, v, True, 0.5, (3, -1), 2.0)
    assert out.shape == (2, 5, 4, 8) and lse.shape == (2, 4, 5)
    ref_out, ref_lse = naive_attention(q.flatten(0, 1), list(k), list(v), [5, 5], 0.5, True, (3, -1), 2.0)
    _compare_attention(out.flatten(0, 1), lse.transpose(0, 1).flatten(1), ref_out, ref_lse, "dense")


@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_sees_cache_bottom_right(q_len, seed):
    hq, hkv, d, block_size = 4, 1, 8, 4
    lengths = [q_len, 9, 14]
    kv = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lengths]
    k_cache, v_cache, table = _paged(kv, block_size, hkv, d, combined=True)
    q = torch.randn(len(lengths), q_len, hq, d)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = reference.decode(q, k_cache, v_cache, cache_seqlens, table, None, True, (5, -1), 0.0)
    assert out.shape == (3, q_len, hq, d) and lse.shape == (3, hq, q_len)
    ref_out, ref_lse = naive_attention(q.flatten(0, 1), [kb for kb, _ in kv], [vb for _, vb in kv], [q_len] * 3,
                                       d**-0.5, True, (5, -1), 0.0)
    _compare_attention(out.flatten(0, 1), lse.transpose(0, 1).flatten(1), ref_out, ref_lse, "decode")


# ----------------------------------------------------------------------------------------------- SSD


def _dt_float64(dt, dt_bias, softplus, limit):
    dt = dt.double() + (dt_bias.double() if dt_bias is not None else 0)
    if softplus:
        dt = F.softplus(dt)
    return dt.clamp(*limit) if limit is not None else dt


def ssd_chunked(x, dt, A, B, C, state, chunk):
    """SSD in its chunked matrix form, float64: x [b,l,h,p], dt [b,l,h] (final), B/C [b,l,h,n], state [b,h,p,n]."""
    y = torch.zeros_like(x)
    for c0 in range(0, x.shape[1], chunk):
        part = slice(c0, c0 + chunk)
        xc, dtc, Bc, Cc = x[:, part], dt[:, part], B[:, part], C[:, part]
        a = torch.cumsum(dtc * A, dim=1)  # [b, Q, h]: log decay from the chunk start
        q = a.shape[1]
        causal = torch.ones(q, q, dtype=torch.bool).tril()[None, :, :, None]
        segment = (a[:, :, None, :] - a[:, None, :, :]).masked_fill(~causal, -math.inf)  # [b, t, s, h]
        scores = torch.einsum("bthn,bshn->btsh", Cc, Bc) * torch.exp(segment)
        y[:, part] = (torch.einsum("btsh,bsh,bshp->bthp", scores, dtc, xc)
                      + torch.einsum("bthn,bhpn,bth->bthp", Cc, state, torch.exp(a)))
        to_end = torch.exp(a[:, -1:, :] - a)
        state = (torch.exp(a[:, -1])[..., None, None] * state
                 + torch.einsum("bsh,bsh,bshp,bshn->bhpn", to_end, dtc, xc, Bc))
    return y, state


def _ssd_inputs(b, l, h, p, g, n):
    return dict(
        x=torch.randn(b, l, h, p), dt=torch.randn(b, l, h) * 0.5, A=-torch.rand(h) * 2 - 0.1,
        B=torch.randn(b, l, g, n), C=torch.randn(b, l, g, n),
    )


@pytest.mark.parametrize("softplus,limit", [(True, (0.0, math.inf)), (False, (0.0, math.inf)), (True, (0.1, 0.6))])
@pytest.mark.parametrize("d_shape", ["none", "h", "hp"])
def test_ssd_sequential_matches_chunked(softplus, limit, d_shape, seed):
    b, l, h, p, g, n = 2, 11, 4, 3, 2, 5
    inp = _ssd_inputs(b, l, h, p, g, n)
    D = {"none": None, "h": torch.randn(h), "hp": torch.randn(h, p)}[d_shape]
    z, dt_bias, state0 = torch.randn(b, l, h, p), torch.randn(h) * 0.3, torch.randn(b, h, p, n)
    y, final = reference.mamba_chunk_scan(**inp, D=D, z=z, dt_bias=dt_bias, initial_states=state0,
                                          dt_softplus=softplus, dt_limit=limit)
    dt = _dt_float64(inp["dt"], dt_bias, softplus, limit)
    Bh = inp["B"].double().repeat_interleave(h // g, dim=2)
    Ch = inp["C"].double().repeat_interleave(h // g, dim=2)
    ref_y, ref_final = ssd_chunked(inp["x"].double(), dt, inp["A"].double(), Bh, Ch, state0.double(), chunk=4)
    if D is not None:
        ref_y = ref_y + inp["x"].double() * (D.double()[:, None] if D.dim() == 1 else D.double())
    ref_y = ref_y * F.silu(z.double())
    assert_close(y, ref_y, rel=1e-5, atol=1e-5, what=f"ssd y seed={seed}")
    assert_close(final, ref_final, rel=1e-5, atol=1e-5, what=f"ssd final state seed={seed}")


def test_ssd_varlen_restarts_each_sequence(seed):
    h, p, g, n = 2, 3, 1, 4
    lengths = [5, 0, 8, 1]
    inp = _ssd_inputs(1, sum(lengths), h, p, g, n)
    cu = _cu(lengths)
    state0 = torch.randn(len(lengths), h, p, n)
    y, finals = reference.mamba_chunk_scan(**inp, initial_states=state0, dt_softplus=True, cu_seqlens=cu)
    assert finals.shape == (len(lengths), h, p, n)
    dt = _dt_float64(inp["dt"], None, True, (0.0, math.inf))
    for s, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = slice(start, end)
        ref_y, ref_final = ssd_chunked(inp["x"][:, part].double(), dt[:, part], inp["A"].double(),
                                       inp["B"][:, part].double().repeat_interleave(h, 2),
                                       inp["C"][:, part].double().repeat_interleave(h, 2),
                                       state0[s : s + 1].double(), chunk=3)
        if end > start:
            assert_close(y[:, part], ref_y, rel=1e-5, atol=1e-5, what=f"sequence {s} y")
        assert_close(finals[s], ref_final[0], rel=1e-5, atol=1e-5, what=f"sequence {s} final state")


@pytest.mark.parametrize("expanded", [False, True])
def test_selective_state_update_is_one_scan_step(expanded, seed):
    b, h, p, g, n, steps = 3, 4, 2, 2, 5, 4
    inp = _ssd_inputs(b, steps, h, p, g, n)
    D, z, dt_bias, state0 = torch.randn(h), torch.randn(b, steps, h, p), torch.randn(h), torch.randn(b, h, p, n)
    y, final = reference.mamba_chunk_scan(**inp, D=D, z=z, dt_bias=dt_bias, initial_states=state0, dt_softplus=True)
    # mamba_ssm's decode layout: A, dt, dt_bias and D broadcast over the head dim (and A over the state dim)
    A = inp["A"][:, None, None].expand(h, p, n) if expanded else inp["A"]
    bias = dt_bias[:, None].expand(h, p) if expanded else dt_bias
    Dp = D[:, None].expand(h, p) if expanded else D
    state = state0.clone()
    for t in range(steps):
        dt = inp["dt"][:, t, :, None].expand(b, h, p) if expanded else inp["dt"][:, t]
        y_t = reference.selective_state_update(state, inp["x"][:, t], dt, A, inp["B"][:, t], inp["C"][:, t],
                                               D=Dp, z=z[:, t], dt_bias=bias, dt_softplus=True)
        assert_close(y_t, y[:, t], rel=1e-5, atol=1e-5, what=f"step {t} y")
    assert_close(state, final, rel=1e-5, atol=1e-5, what="state after the steps")


# --------------------------------------------------------------------------------------------- Based


def naive_based(q, k, v, scale, use_norm, eps):
    bsz, n, h, _ = q.shape
    out = torch.zeros(bsz, n, h, v.shape[-1], dtype=torch.float64)
    for b in range(bsz):
        for hh in range(h):
            for i in range(n):
                num, den = torch.zeros(v.shape[-1], dtype=torch.float64), 0.0
                for j in range(i + 1):
                    s = float((q[b, i, hh].double() * k[b, j, hh].double()).sum()) * scale
                    w = 1 + s + s * s / 2
                    num += w * v[b, j, hh].double()
                    den += w
                out[b, i, hh] = num / (den + eps) if use_norm else num
    return out


@pytest.mark.parametrize("use_norm", [True, False])
def test_based_matches_loops(use_norm, seed):
    q, k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 8)
    out = reference.based(q, k, v, use_norm=use_norm)
    assert_close(out, naive_based(q, k, v, 0.25, use_norm, 1e-6), rel=1e-5, atol=1e-5, what=f"based seed={seed}")


@pytest.mark.parametrize("use_norm", [True, False])
def test_based_prefill_then_steps_equals_parallel(use_norm, seed):
    bsz, n, h, dk, dv, prefix = 2, 9, 3, 16, 8, 4
    q, k, v = torch.randn(bsz, n, h, dk), torch.randn(bsz, n, h, dk), torch.randn(bsz, n, h, dv)
    full = reference.based(q, k, v, use_norm=use_norm)
    state = reference.based_prefill_state(k[:, :prefix], v[:, :prefix])
    for t in range(prefix, n):
        o, state = reference.based_step(q[:, t], k[:, t], v[:, t], state, use_norm=use_norm)
        assert_close(o, full[:, t], rel=1e-5, atol=1e-5, what=f"step {t}")
    longer = reference.based_prefill_state(k, v)
    for got, want, name in zip(state, longer, longer._fields):
        assert_close(got, want, rel=1e-5, atol=1e-5, what=f"state.{name}")


def test_based_steps_from_empty_state(seed):
    q, k, v = torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 4)
    state = reference.based_prefill_state(k[:, :0], v[:, :0])
    assert all((s == 0).all() for s in state)
    outs = []
    for t in range(5):
        o, state = reference.based_step(q[:, t], k[:, t], v[:, t], state, scale=0.3)
        outs.append(o)
    assert_close(torch.stack(outs, 1), reference.based(q, k, v, scale=0.3), rel=1e-5, atol=1e-5, what="from empty")
