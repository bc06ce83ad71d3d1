"""Attention prefill against the float32 reference: dense and varlen, GQA, causal, windows, softcap, paged."""
from __future__ import annotations

import random

import pytest
import torch

import tk_backend
from tk_backend import reference
from tests.accuracy import assert_close

pytestmark = pytest.mark.gpu


def _lengths(rng: random.Random, batch: int, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(batch)]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")


def _check(out, lse, ref_out, ref_lse, what):
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=f"{what} out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finiteness differs from the reference"
    assert_close(lse[finite], ref_lse[finite], rel=1e-3, atol=1e-3, what=f"{what} lse")


def _boost_keys(k, lengths, positions, boost):
    """Scales the keys at positions(n) of each sequence (n its length) of the packed k by boost."""
    start = 0
    for n in lengths:
        for pos in positions(n):
            k[start + pos] *= boost
        start += n


def _run_and_check(q, k, v, cu_q, cu_k, max_q, max_k, what, **kw):
    """flash_attn_varlen_func into a NaN-poisoned output, against the float32 reference with the same arguments."""
    out = torch.full_like(q, float("nan"))
    _, lse = tk_backend.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, out=out, return_softmax_lse=True,
                                               **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.attention(q, k, v, cu_q, cu_k, **kw)
    _check(out, lse, ref_out, ref_lse, what)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_varlen(d, causal, group, seed):
    rng = random.Random(seed)
    hkv = 2
    hq = hkv * group
    lq = _lengths(rng, 5, 1, 700)
    lk = [q + rng.randint(0, 300) for q in lq] if rng.random() < 0.5 else lq
    q = torch.randn(sum(lq), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.bfloat16)
    _run_and_check(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk),
                   f"varlen d={d} causal={causal} group={group} lq={lq} lk={lk} seed={seed}", causal=causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_many_tasks_per_cta(d, causal, seed):
    """Dozens of tasks per CTA of the persistent grid, so every hand-over from one task to the next runs:
    lengths from 0 to 1500 (an empty sequence, one with queries but no keys, lengths not a multiple of any
    tile), GQA 4."""
    rng = random.Random(seed)
    hkv, hq = 4, 16
    lq = _lengths(rng, 40, 1, 1500)
    lq[rng.randrange(40)] = 0
    lk = [q + rng.randint(0, 200) if rng.random() < 0.5 else rng.randint(0, 1500) for q in lq]
    lk[rng.randrange(40)] = 0
    q = torch.randn(sum(lq), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.bfloat16)
    _run_and_check(q, k, v, _cu(lq), _cu(lk), max(lq), max(max(lk), 1),
                   f"many tasks d={d} causal={causal} lq={lq} lk={lk} seed={seed}", causal=causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("boost", [6.0, 60.0, 2000.0])
@pytest.mark.parametrize("longest", [1000, 2000])
def test_score_jumps(d, causal, boost, longest, seed):
    """A few keys far stronger than every one before them, late in long sequences: the running max jumps mid-task
    by a little, by a lot (the softmax's fast path hands the tile to its exact step) and by more than 2^128 (its
    probabilities overflow). Sequences of up to 1000 and up to 2000 tokens (D=128's two kernels)."""
    rng = random.Random(seed)
    lq = _lengths(rng, 3, 400, longest)
    q = torch.randn(sum(lq), 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lq), 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lq), 2, d, device="cuda", dtype=torch.bfloat16)
    _boost_keys(k, lq, lambda n: rng.sample(range(300, n), 3), boost)
    cu = _cu(lq)
    _run_and_check(q, k, v, cu, cu, max(lq), max(lq),
                   f"score jumps d={d} causal={causal} boost={boost} lq={lq} seed={seed}", causal=causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("boost", [6.0, 60.0, 2000.0])
def test_first_tile_jumps(d, causal, boost, seed):
    """A strong key inside a task's first key tile but past its first 16 keys, where D=64 guesses each row's max for
    the fast softmax: a guess too low by a little (the fast path holds), by a lot (the exact step takes the tile
    over) and by more than 2^128."""
    rng = random.Random(seed)
    lq = _lengths(rng, 6, 130, 1000)
    q = torch.randn(sum(lq), 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lq), 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lq), 2, d, device="cuda", dtype=torch.bfloat16)
    _boost_keys(k, lq, lambda n: [rng.randrange(16, 128)], boost)
    cu = _cu(lq)
    _run_and_check(q, k, v, cu, cu, max(lq), max(lq),
                   f"first-tile jumps d={d} causal={causal} boost={boost} lq={lq} seed={seed}", causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("boost", [1.0, 60.0, 2000.0])
def test_half_last_tiles(causal, dtype, boost, seed):
    """D=64 runs a consumer's last key tile on its first 64 keys where its rows see none of the other 64: sequences
    that end in a tile's first half (every consumer's last tile, causal or not), causal diagonals whose rows start at
    a multiple of 128, and chunks of fewer queries than keys (bottom-right alignment moves the diagonal). A strong key
    inside those half tiles sends their fast softmax to the exact step (boost 60) or overflows it (2000)."""
    rng = random.Random(seed)
    lk = [128 * rng.randint(1, 8) + rng.randint(1, 64) for _ in range(3)] + [1024, 64, 192]
    lq = [n if i % 2 else max(1, n - 64 * rng.randint(0, 3)) for i, n in enumerate(lk)]
    q = torch.randn(sum(lq), 4, 64, device="cuda", dtype=dtype)
    k = torch.randn(sum(lk), 2, 64, device="cuda", dtype=dtype)
    v = torch.randn(sum(lk), 2, 64, device="cuda", dtype=dtype)
    if boost != 1.0:
        _boost_keys(k, lk, lambda n: [128 * m + rng.randrange(0, 64) for m in range(0, (n + 127) // 128, 2)], boost)
    _run_and_check(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk),
                   f"half last tiles causal={causal} {dtype} boost={boost} lq={lq} lk={lk} seed={seed}", causal=causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,softcap", [((64, 0), 0.0), ((100, 37), 0.0), ((-1, -1), 30.0), ((256, -1), 5.0)])
def test_window_softcap(d, causal, window, softcap, seed):
    """Sliding windows and softcaps at every head dim, with and without a causal mask (D=64 runs a kernel of its own
    when a softcap is set; causal masks at D=256 run the claimed-task kernel)."""
    rng = random.Random(seed)
    lq = _lengths(rng, 3, 50, 600)
    q = torch.randn(sum(lq), 8, d, device="cuda", dtype=torch.float16)
    k = torch.randn(sum(lq), 2, d, device="cuda", dtype=torch.float16)
    v = torch.randn(sum(lq), 2, d, device="cuda", dtype=torch.float16)
    cu = _cu(lq)
    _run_and_check(q, k, v, cu, cu, max(lq), max(lq), f"d={d} causal={causal} window={window} softcap={softcap} "
                   f"seed={seed}", causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("combined", [False, True])
def test_paged(block_size, combined, seed):
    """Chunked prefill over a prefix cache: new queries attend to cached + new keys through shuffled pages."""
    rng = random.Random(seed)
    d, hkv, hq = 128, 4, 16
    new = _lengths(rng, 4, 1, 300)
    ctx = [n + rng.randint(0, 900) for n in new]
    max_blocks = max(-(-c // block_size) for c in ctx) + 1
    num_blocks = len(ctx) * max_blocks + 7
    if combined:  # vLLM's layout: K and V are the two halves of the last dim of one tensor
        kv = torch.randn(num_blocks, block_size, hkv, 2 * d, device="cuda", dtype=torch.bfloat16)
        k_cache, v_cache = kv[..., :d], kv[..., d:]
    else:
        k_cache = torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    block_table = perm[: len(ctx) * max_blocks].view(len(ctx), max_blocks).contiguous()
    q = torch.randn(sum(new), hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = _cu(new)
    seqused = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    _run_and_check(q, k_cache, v_cache, cu_q, None, max(new), max(ctx),
                   f"paged bs={block_size} combined={combined} new={new} ctx={ctx} seed={seed}", causal=True,
                   block_table=block_table, seqused_k=seqused)


def test_dense_batched(seed):
    q = torch.randn(2, 1000, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1000, 8, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1000, 8, 64, device="cuda", dtype=torch.bfloat16)
    out = tk_backend.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    ref = reference.attention_dense(q, k, v, causal=True)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"dense seed={seed}")


def test_graph_capture(seed):
    lq = [300, 5, 129]
    q = torch.randn(sum(lq), 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = _cu(lq)
    out = torch.empty_like(q)
    tk_backend.flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tk_backend.flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True, out=out)
    q.copy_(torch.randn_like(q))
    cu.copy_(_cu([200, 100, 134]))  # same total, new boundaries
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = reference.attention(q, k, v, cu, cu, causal=True)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what="graph replay")
