"""Attention sinks, small sliding windows (D=64's window kernel), every head size FA3 serves (multiples of 8 up to 256)
and bidirectional attention, prefill and decode, against the float32 reference, into NaN-poisoned outputs."""
from __future__ import annotations

import random

import pytest
import torch

import tk_backend
from tk_backend import reference
from tests.gpu.test_attention import _check, _cu
from tests.gpu.test_decode import check_graph_replay

pytestmark = pytest.mark.gpu

RAGGED_HEAD_DIMS = [32, 48, 80, 96, 112, 160, 192, 224]


def _sinks(hq: int, rng: random.Random) -> torch.Tensor:
    """Sink logits around the scores' scale, with one far above (its heads' rows go to ~0) and one far below."""
    s = torch.randn(hq, device="cuda", dtype=torch.float32) * 2
    s[rng.randrange(hq)] = 40.0
    s[rng.randrange(hq)] = -40.0
    return s


def _varlen_case(rng, d, hkv, group, dtype, lengths_q, extra_k):
    lq = lengths_q
    lk = [n + extra_k for n in lq]
    q = torch.randn(sum(lq), hkv * group, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lk), hkv, d, device="cuda", dtype=dtype)
    return q, k, v, lq, lk


def _prefill(q, k, v, lq, lk, what, **kw):
    out = torch.full_like(q, float("nan"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    _, lse = tk_backend.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), out=out,
                                               return_softmax_lse=True, **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.attention(q, k, v, cu_q, cu_k, **kw)
    _check(out, lse, ref_out, ref_lse, what)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (127, 0)), (False, (-1, -1))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_sinks(d, causal, window, dtype, seed):
    """gpt-oss's layers: sinks with full and 128-token windows (head dim 64, GQA 8), and the other tile head dims."""
    rng = random.Random(seed)
    group = 8 if d == 64 else 2
    lq = [rng.randint(1, 1500) for _ in range(4)]
    q, k, v, lq, lk = _varlen_case(rng, d, 2, group, dtype, lq, rng.choice([0, 37]))
    sinks = _sinks(q.shape[1], rng)
    _prefill(q, k, v, lq, lk, f"sinks d={d} causal={causal} window={window} {dtype} lq={lq} seed={seed}",
             causal=causal, window_size=window, sinks=sinks)


# D=64 under a window of at most 128 keys besides a query's own runs d64_window (prefill/policy.cuh): each consumer
# computes only the tiles its 64 rows see, starting at a tile's second half or ending at its first where they see
# no more. Windows on both sides of that bound (129, 64 + 65: the overlapped kernel) and of the half-tile edges,
# causal or with a right window, and the keys per query equal to, 1 over or 1 under a multiple of 64.
SMALL_WINDOWS = [(True, (0, 0)), (True, (1, 0)), (True, (63, 0)), (True, (64, 0)), (True, (65, 0)), (True, (127, 0)),
                 (True, (128, 0)), (True, (129, 0)), (True, (64, 37)), (False, (63, 64)), (False, (64, 64)),
                 (False, (0, 128)), (False, (127, 0)), (False, (1, 1)), (False, (64, 65))]


def _small_window_lengths(rng: random.Random) -> tuple[list[int], list[int]]:
    """Query lengths around multiples of 64 and 192 (a task's rows) and random ones; keys as many, a few more (the
    diagonal off a half tile's edge), many more (chunked prefill), or fewer (the first rows see no key)."""
    lq = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 385] + [rng.randint(1, 1500) for _ in range(9)]
    rng.shuffle(lq)
    lk = [max(1, n + rng.choice([0, 0, 1, 15, 37, 64, 300, -5, -70])) for n in lq]
    return lq, lk


@pytest.mark.parametrize("causal,window", SMALL_WINDOWS)
@pytest.mark.parametrize("sinks", [False, True])
def test_prefill_small_windows(causal, window, sinks, seed):
    rng = random.Random(seed)
    lq, lk = _small_window_lengths(rng)
    hkv, group, d = 2, 8, 64  # gpt-oss's GQA
    q = torch.randn(sum(lq), hkv * group, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.bfloat16)
    _prefill(q, k, v, lq, lk, f"small window causal={causal} window={window} sinks={sinks} lq={lq} lk={lk} "
             f"seed={seed}", causal=causal, window_size=window, sinks=_sinks(hkv * group, rng) if sinks else None)


@pytest.mark.parametrize("window", [(127, 0), (128, 0), (64, 0)])
@pytest.mark.parametrize("boost", [60.0, 2000.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_small_window_jumps(window, boost, dtype, seed):
    """Strong keys all over the windows (so in half tiles at both ends of a consumer's): the running max jumps in a
    consumer's later tile, whose fast softmax hands it to the exact step (60) or overflows (2000); the exact step's
    S must be the half tile's own keys."""
    rng = random.Random(seed)
    lq, lk = _small_window_lengths(rng)
    q = torch.randn(sum(lq), 8, 64, device="cuda", dtype=dtype)
    k = torch.randn(sum(lk), 2, 64, device="cuda", dtype=dtype)
    v = torch.randn(sum(lk), 2, 64, device="cuda", dtype=dtype)
    start = 0
    for n in lk:
        for pos in rng.sample(range(n), min(n, max(1, n // 40))):
            k[start + pos] *= boost
        start += n
    _prefill(q, k, v, lq, lk, f"small window jumps window={window} boost={boost} {dtype} lq={lq} lk={lk} seed={seed}",
             causal=True, window_size=window)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [(127, 0), (128, 0), (33, 0)])
def test_prefill_small_windows_paged(block_size, window, seed):
    """gpt-oss's windowed layers as vLLM runs them: chunked prefill over a paged cache (shuffled pages), sinks."""
    rng = random.Random(seed)
    hkv, group, d = 2, 8, 64
    lq = [rng.randint(1, 700) for _ in range(5)] + [1, 192]
    lk = [n + rng.choice([0, 3, rng.randint(0, 900)]) for n in lq]
    _paged_prefill(lq, lk, block_size, hkv, group, d, 3,
                   f"small window paged bs={block_size} window={window} lq={lq} lk={lk} seed={seed}",
                   causal=True, window_size=window, sinks=_sinks(hkv * group, rng))


def _paged_prefill(lq, lk, block_size, hkv, group, d, spare_blocks, what, **kw):
    """Chunked prefill of queries lq over contexts lk in a paged cache as vLLM keeps it (shuffled pages, its K|V
    layout, spare_blocks never read), into a NaN-poisoned out, against the float32 reference."""
    max_blocks = max(-(-n // block_size) for n in lk) + 1
    num_blocks = len(lq) * max_blocks + spare_blocks
    kv = torch.randn(num_blocks, block_size, hkv, 2 * d, device="cuda", dtype=torch.bfloat16)  # vLLM's K|V layout
    k_cache, v_cache = kv[..., :d], kv[..., d:]
    table = torch.randperm(num_blocks, device="cuda")[: len(lq) * max_blocks].to(torch.int32).view(len(lq), -1)
    q = torch.randn(sum(lq), hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqused = torch.tensor(lk, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    _, lse = tk_backend.flash_attn_varlen_func(q, k_cache, v_cache, _cu(lq), None, max(lq), max(lk), out=out,
                                               block_table=table.contiguous(), seqused_k=seqused,
                                               return_softmax_lse=True, **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.attention(q, k_cache, v_cache, _cu(lq), None, block_table=table, seqused_k=seqused,
                                           **kw)
    _check(out, lse, ref_out, ref_lse, what)


@pytest.mark.parametrize("d", RAGGED_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_ragged_head_dims(d, causal, seed):
    rng = random.Random(seed)
    lq = [rng.randint(1, 1400) for _ in range(3)] + [2100]  # the second D=128 kernel past 1024 keys
    q, k, v, lq, lk = _varlen_case(rng, d, 2, 4, torch.bfloat16, lq, rng.choice([0, 5]))
    _prefill(q, k, v, lq, lk, f"head dim {d} causal={causal} lq={lq} seed={seed}", causal=causal)


@pytest.mark.parametrize("d", [96, 80, 192])
def test_prefill_ragged_head_dims_paged_window_softcap(d, seed):
    rng = random.Random(seed)
    lq = [rng.randint(1, 700) for _ in range(3)]
    lk = [n + rng.randint(0, 600) for n in lq]
    _paged_prefill(lq, lk, 16, 2, 4, d, 2, f"paged head dim {d} lq={lq} lk={lk} seed={seed}",
                   causal=True, window_size=(200, 0), softcap=30.0)


@pytest.mark.parametrize("window", [(-1, -1), (64, 64), (100, 20)])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_bidirectional_windows(window, d, seed):
    """Encoder-only attention: no causal mask, symmetric (and asymmetric) windows."""
    rng = random.Random(seed)
    lq = [rng.randint(1, 900) for _ in range(5)]
    q, k, v, lq, lk = _varlen_case(rng, d, 4, 1, torch.float16, lq, 0)
    _prefill(q, k, v, lq, lk, f"bidirectional d={d} window={window} seed={seed}", causal=False, window_size=window)


def _decode_case(rng, batch, contexts, q_len, bs, hkv, group, d, dtype=torch.bfloat16):
    max_blocks = max(-(-c // bs) for c in contexts) + 2
    num_blocks = batch * max_blocks + 3
    kv = torch.randn(num_blocks, bs, hkv, 2 * d, device="cuda", dtype=dtype)
    table = torch.randperm(num_blocks, device="cuda")[: batch * max_blocks].to(torch.int32).view(batch, max_blocks)
    q = torch.randn(batch, q_len, hkv * group, d, device="cuda", dtype=dtype)
    return q, kv[..., :d], kv[..., d:], table.contiguous(), torch.tensor(contexts, dtype=torch.int32, device="cuda")


def _decode(q, k_cache, v_cache, seqlens, table, what, **kw):
    out = torch.full_like(q, float("nan"))
    _, lse = tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out, return_softmax_lse=True,
                                                **kw)
    torch.cuda.synchronize()
    kw.pop("num_splits", None)
    ref_out, ref_lse = reference.decode(q, k_cache, v_cache, seqlens, table, **kw)
    _check(out, lse, ref_out, ref_lse, what)


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
@pytest.mark.parametrize("window", [(-1, -1), (127, 0)])
def test_decode_sinks(q_len, num_splits, window, seed):
    """gpt-oss's shape (head dim 64, 64 query heads on 8 kv heads: group 8); whole items, splits and the merge."""
    rng = random.Random(seed)
    batch, hkv, group, d = 5, 2, 8, 64
    contexts = [rng.choice([q_len, rng.randint(q_len, 400), rng.randint(1000, 9000)]) for _ in range(batch)]
    q, k_cache, v_cache, table, seqlens = _decode_case(rng, batch, contexts, q_len, 16, hkv, group, d)
    sinks = _sinks(hkv * group, rng)
    _decode(q, k_cache, v_cache, seqlens, table, f"decode sinks q_len={q_len} splits={num_splits} window={window} "
            f"ctx={contexts} seed={seed}", window_size=window, sinks=sinks, num_splits=num_splits)


@pytest.mark.parametrize("d", RAGGED_HEAD_DIMS)
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_ragged_head_dims(d, q_len, seed):
    rng = random.Random(seed)
    batch, hkv, group = 6, 2, 4
    contexts = [rng.choice([q_len, rng.randint(q_len, 300), rng.randint(1000, 12000)]) for _ in range(batch)]
    q, k_cache, v_cache, table, seqlens = _decode_case(rng, batch, contexts, q_len, 32, hkv, group, d)
    _decode(q, k_cache, v_cache, seqlens, table, f"decode head dim {d} q_len={q_len} ctx={contexts} seed={seed}")


def test_decode_bidirectional(seed):
    """Non-causal decoder layers: a step's q_len new tokens see each other (and every cached key)."""
    rng = random.Random(seed)
    contexts = [rng.randint(4, 3000) for _ in range(4)]
    q, k_cache, v_cache, table, seqlens = _decode_case(rng, 4, contexts, 4, 16, 2, 4, 128)
    _decode(q, k_cache, v_cache, seqlens, table, f"decode non-causal ctx={contexts} seed={seed}", causal=False)


@pytest.mark.parametrize("d,sinks", [(64, True), (96, False)])
def test_decode_graph_replay_sinks_and_ragged(d, sinks, seed):
    """Capture once; replay after the contexts and block tables change."""
    rng = random.Random(seed)
    batch, hkv, group = 8, 8, 8
    q, k_cache, v_cache, table, seqlens = _decode_case(rng, batch, [6000] * batch, 1, 16, hkv, group, d)
    sink_logits = _sinks(hkv * group, rng) if sinks else None
    seqlens.fill_(100)
    check_graph_replay(rng, q, k_cache, v_cache, seqlens, table, 6000, f"graph replay d={d} sinks={sinks} seed={seed}",
                       sinks=sink_logits)


def test_sinks_need_a_tile_head_dim():
    q = torch.randn(8, 4, 96, device="cuda", dtype=torch.bfloat16)
    cu = _cu([8])
    with pytest.raises((ValueError, RuntimeError), match="sinks"):
        tk_backend.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, sinks=torch.zeros(4, device="cuda"))
