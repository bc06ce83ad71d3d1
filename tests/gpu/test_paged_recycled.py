"""Paged attention over recycled pages: every cache row that no query may see holds NaN.

A serving engine's cache is not clean past a sequence's end: the rest of its last page holds whatever the page
held before (in vLLM's hybrid models attention pages share memory with recurrent state slots, whose float32
bits read as 16-bit values include NaN and Inf), and a sliding-window cache hands the pages behind the window
back, pointing their block-table entries at a shared null page. Masked scores give P = 0, but 0 * NaN is NaN
in P V, so a kernel must never let such rows reach it. Each test poisons those rows and the null page with
NaN and compares against the float32 reference on a clean copy (same block tables).
"""
from __future__ import annotations

import random

import pytest
import torch

import tk_backend
from tk_backend import reference
from tests.accuracy import assert_close

pytestmark = pytest.mark.gpu

NULL_PAGE = 0


def _recycled_cache(rng, contexts, first_visible, block_size, hkv, d, dtype):
    """K/V caches [num_blocks, block_size, hkv, d] (vLLM's combined layout), their block table (page 0 is the
    null page, never owned), the clean copies, and the poisoned ones: NaN in every row past a sequence's end,
    in the null page, and in unowned pages; pages wholly before first_visible[b] point at the null page."""
    batch = len(contexts)
    max_blocks = max(-(-c // block_size) for c in contexts) + 1
    num_blocks = batch * max_blocks + 4
    kv = torch.randn(num_blocks, block_size, hkv, 2 * d, device="cuda", dtype=dtype)
    owned = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) + 1)
    table = owned[: batch * max_blocks].to(torch.int32).view(batch, max_blocks).clone()  # on the host while built
    poisoned = torch.full_like(kv, float("nan"))
    for b, (length, lo) in enumerate(zip(contexts, first_visible)):
        for j in range(max_blocks):
            page = int(table[b, j])
            rows = min(block_size, max(0, length - j * block_size))
            if (j + 1) * block_size <= lo:  # behind the window: handed back
                table[b, j] = NULL_PAGE
            elif rows:
                poisoned[page, :rows] = kv[page, :rows]
    kv[NULL_PAGE] = 0  # the clean copy's null page: any finite value gives the same masked result
    return (kv[..., :d], kv[..., d:]), (poisoned[..., :d], poisoned[..., d:]), table.cuda()


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [(-1, -1), (100, 0)])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_ignores_recycled_rows(block_size, window, d, seed):
    rng = random.Random(seed)
    hkv, hq, dtype = 2, 8, torch.bfloat16
    new = [rng.randint(1, 300) for _ in range(4)]
    contexts = [n + rng.randint(0, 700) for n in new]
    first_visible = [max(0, c - n - window[0]) if window[0] >= 0 else 0 for c, n in zip(contexts, new)]
    (k, v), (k_bad, v_bad), table = _recycled_cache(rng, contexts, first_visible, block_size, hkv, d, dtype)
    q = torch.randn(sum(new), hq, d, device="cuda", dtype=dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32, device="cuda")
    seqused = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out, lse = tk_backend.flash_attn_varlen_func(q, k_bad, v_bad, cu_q, None, max(new), max(contexts), causal=True,
                                                 window_size=window, block_table=table, seqused_k=seqused,
                                                 return_softmax_lse=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.attention(q, k, v, cu_q, None, causal=True, window_size=window, block_table=table,
                                           seqused_k=seqused)
    what = f"prefill bs={block_size} window={window} d={d} new={new} ctx={contexts} seed={seed}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=what)
    finite = torch.isfinite(ref_lse)
    assert_close(lse[finite], ref_lse[finite], rel=1e-3, atol=1e-3, what=what + " lse")


@pytest.mark.parametrize("q_len,group", [(1, 8), (16, 8)])  # the split-KV kernel; the paged prefill kernel
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("window", [(-1, -1), (200, 0)])
def test_decode_ignores_recycled_rows(q_len, group, block_size, window, seed):
    rng = random.Random(seed)
    hkv, d, dtype = 2, 128, torch.bfloat16
    contexts = [rng.choice([q_len, rng.randint(q_len, 500), rng.randint(2000, 9000)]) for _ in range(5)]
    first_visible = [max(0, c - q_len - window[0]) if window[0] >= 0 else 0 for c in contexts]
    (k, v), (k_bad, v_bad), table = _recycled_cache(rng, contexts, first_visible, block_size, hkv, d, dtype)
    q = torch.randn(len(contexts), q_len, hkv * group, d, device="cuda", dtype=dtype)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out, lse = tk_backend.flash_attn_with_kvcache(q, k_bad, v_bad, seqlens, table, window_size=window,
                                                  return_softmax_lse=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.decode(q, k, v, seqlens, table, window_size=window)
    what = f"decode q_len={q_len} bs={block_size} window={window} ctx={contexts} seed={seed}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=what)
    assert_close(lse, ref_lse, rel=1e-3, atol=1e-3, what=what + " lse")
