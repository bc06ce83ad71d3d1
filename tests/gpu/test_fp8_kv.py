"""FP8 (e4m3) KV caches: decode (the split kernel's fp8 flavour, which dequantizes each K/V tile on chip) and prefill
over a paged fp8 cache (dequantized into a 16-bit scratch cache first), against the float32 reference on the
dequantized cache (tk_backend.reference: stored * descale exactly, so the only error is the kernel's).

Every cache is vLLM's combined K|V layout unless a test says otherwise: [blocks, block_size, kv_heads, 2 * D] split
into halves. Each sequence's last page holds e4m3 NaN bytes past its end, as a recycled page may; outputs are
written into NaN-poisoned buffers, so an unwritten element fails.
"""
from __future__ import annotations

import multiprocessing
import random

import pytest
import torch

import tk_backend
from tk_backend import attention, reference
from tests.accuracy import assert_close

pytestmark = pytest.mark.gpu

E4M3_NAN = 0x7F


def _fp8_cache(rng, contexts, block_size, hkv, d, combined=True, storage=torch.float8_e4m3fn):
    """K and V caches of float8_e4m3fn values (or their uint8 bytes), a shuffled block table with room to spare, and
    NaN bytes in every row past a sequence's end (its last page's tail)."""
    batch = len(contexts)
    max_blocks = max(-(-c // block_size) for c in contexts) + 2
    num_blocks = batch * max_blocks + 3
    width = 2 * d if combined else d
    kv = [(torch.randn(num_blocks, block_size, hkv, width, device="cuda") * 2).to(torch.float8_e4m3fn)
          for _ in range(1 if combined else 2)]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    table = perm[: batch * max_blocks].to(torch.int32).view(batch, max_blocks)
    for b, length in enumerate(contexts):
        if length % block_size:
            for t in kv:
                t.view(torch.uint8)[int(table[b, length // block_size]), length % block_size:] = E4M3_NAN
    if storage == torch.uint8:
        kv = [t.view(torch.uint8) for t in kv]
    k, v = (kv[0][..., :d], kv[0][..., d:]) if combined else (kv[0], kv[1])
    return k, v, table.cuda()


def _descales(kind, batch, hkv, rng):
    """None, a per-tensor scale expanded to [batch, kv_heads] (strides 0, as vLLM passes layer._k_scale), or one per
    (sequence, kv head)."""
    if kind == "none":
        return None
    if kind == "tensor":
        return torch.tensor([rng.uniform(0.25, 2.0)], device="cuda").expand(batch, hkv)
    return torch.rand(batch, hkv, device="cuda") * 1.75 + 0.25


def _decode_case(rng, contexts, q_len, group, d, block_size, dtype=torch.bfloat16, hkv=2, descale="seq",
                 combined=True, storage=torch.float8_e4m3fn):
    k, v, table = _fp8_cache(rng, contexts, block_size, hkv, d, combined, storage)
    q = torch.randn(len(contexts), q_len, hkv * group, d, device="cuda", dtype=dtype)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    scales = {name: _descales(descale, len(contexts), hkv, rng) for name in ("k_descale", "v_descale")}
    return q, k, v, seqlens, table, scales


def _check_decode(q, k, v, seqlens, table, scales, what, **kw):
    out = torch.full_like(q, float("nan"))
    _, lse = tk_backend.flash_attn_with_kvcache(q, k, v, seqlens, table, out=out, return_softmax_lse=True, **scales,
                                                **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.decode(q, k, v, seqlens, table, **scales, **{n: x for n, x in kw.items()
                                                                              if n != "num_splits"})
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=what)
    assert_close(lse, ref_lse, rel=1e-3, atol=1e-3, what=what + " lse")


@pytest.mark.parametrize("d", [64, 128, 256, 96])
@pytest.mark.parametrize("q_len,group", [(1, 1), (1, 8), (4, 4), (4, 16)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_fp8_decode(d, q_len, group, block_size, num_splits, seed):
    rng = random.Random(seed)
    contexts = [rng.choice([q_len, rng.randint(q_len, 400), rng.randint(1000, 9000)]) for _ in range(5)]
    dtype = rng.choice([torch.bfloat16, torch.float16])
    case = _decode_case(rng, contexts, q_len, group, d, block_size, dtype)
    _check_decode(*case, f"fp8 decode d={d} q_len={q_len} group={group} bs={block_size} splits={num_splits} "
                         f"{dtype} ctx={contexts} seed={seed}", num_splits=num_splits)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window,softcap", [((128, 0), 0.0), ((-1, -1), 20.0), ((300, -1), 30.0)])
def test_fp8_decode_window_softcap(d, window, softcap, seed):
    rng = random.Random(seed)
    contexts = [rng.randint(2, 4000) for _ in range(4)]
    case = _decode_case(rng, contexts, 2, 8, d, 32, torch.float16)
    _check_decode(*case, f"fp8 decode d={d} window={window} softcap={softcap} ctx={contexts} seed={seed}",
                  window_size=window, softcap=softcap)


@pytest.mark.parametrize("descale", ["none", "tensor", "seq"])
@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.uint8])
@pytest.mark.parametrize("combined", [True, False])
def test_fp8_decode_descales_and_layouts(descale, storage, combined, seed):
    """Per-tensor (expanded, strides 0), per-(sequence, head) and no descales; uint8 caches (vLLM's allocation) and
    separate K and V caches beside the combined layout; a q_descale that is not one (flash-attn's meaning: q * it)."""
    rng = random.Random(seed)
    contexts = [rng.randint(1, 6000) for _ in range(6)]
    q, k, v, seqlens, table, scales = _decode_case(rng, contexts, 1, 4, 128, 16, descale=descale, combined=combined,
                                                   storage=storage)
    if descale == "seq":
        scales["q_descale"] = torch.rand(6, 2, device="cuda") + 0.5
    _check_decode(q, k, v, seqlens, table, scales, f"fp8 decode descale={descale} {storage} combined={combined} "
                  f"ctx={contexts} seed={seed}")


def test_fp8_decode_sinks(seed):
    rng = random.Random(seed)
    contexts = [rng.randint(1, 3000) for _ in range(4)]
    case = _decode_case(rng, contexts, 1, 8, 64, 16)
    sinks = torch.randn(16, device="cuda") * 2
    for window in [(-1, -1), (128, 0)]:
        _check_decode(*case, f"fp8 decode sinks window={window} seed={seed}", sinks=sinks, window_size=window)


_MANY = list(range(40, 64 * 97, 97))  # 64 sequences of 40 .. 6151 keys


def _planned_step(rng, contexts, width, num_splits):
    """A bf16 query (2 kv heads, groups of 4, D=128) over an fp8 cache of block size 16 whose table is `width` keys
    wide (unused columns: page 0), and its PagedDecode plan: (q, k, v, seqlens, table, decode)."""
    block_size, hkv, group, d = 16, 2, 4, 128
    k, v, table = _fp8_cache(rng, contexts, block_size, hkv, d)
    table = torch.nn.functional.pad(table, (0, width // block_size - table.shape[1]))
    q = torch.randn(len(contexts), 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    decode = attention.PagedDecode(attention.DecodeWorkspacePool()).plan(
        seqlens, table, num_q_heads=hkv * group, num_kv_heads=hkv, head_dim=d, page_size=block_size,
        num_splits=num_splits, kv_cache_dtype=k.dtype)
    return q, k, v, seqlens, table, decode


@pytest.mark.parametrize("contexts,width,num_splits,expect", [
    ([5000, 3, 7000, 120], 8192, 8, ("direct", 64)),         # few items: a CTA each
    (_MANY, 8192, 4, ("scheduled", 64)),                     # each CTA works out its range
    (_MANY + _MANY[:16], 8192, 1, ("scheduled", 128)),       # one item a sequence (a 16-bit q: 64-key tiles)
    ([100_000, 17, 1, 900], 131072, 0, ("balanced", 64)),    # one long sequence in a wide table
    (_MANY, 131072, 0, ("balanced", 128)),                   # batch 64 (balanced_fp8_kv128)
])
def test_fp8_decode_modes(contexts, width, num_splits, expect, seed):
    """Every schedule the split kernel runs (direct, self-scheduled, balanced) over fp8 (64- and 128-key tiles at
    D=128). The unforced cases take the H200 table's plans: a re-tuned table may move them (the assert says)."""
    rng = random.Random(seed)
    q, k, v, seqlens, table, decode = _planned_step(rng, contexts, width, num_splits)
    hkv = k.shape[2]
    plan = decode.split_plan
    mode = "balanced" if decode.balanced else "direct" if plan.max_items <= plan.num_ctas else "scheduled"
    assert (mode, decode.kv_tile) == expect, plan
    scales = {name: _descales("seq", len(contexts), hkv, rng) for name in ("k_descale", "v_descale")}
    out = torch.full_like(q, float("nan"))
    for _ in range(2):  # the second run reuses the schedule
        decode.run(q, k, v, out, **scales)
    torch.cuda.synchronize()
    ref = reference.decode(q, k, v, seqlens, table, **scales)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"fp8 decode {expect} seed={seed}")


def _replay_cache(rng, batch=8, hkv=8, d=128):
    """An fp8 cache of `batch` 4000-key sequences (block size 16) and their lengths, 100 keys each for the capture."""
    k, v, table = _fp8_cache(rng, [4000] * batch, 16, hkv, d)
    return k, v, table, torch.full((batch,), 100, dtype=torch.int32, device="cuda")


def _captured_decode(q, k, v, seqlens, table, out, **scales):
    """flash_attn_with_kvcache run once, then captured into a CUDA graph, which is returned."""
    tk_backend.flash_attn_with_kvcache(q, k, v, seqlens, table, out=out, **scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk_backend.flash_attn_with_kvcache(q, k, v, seqlens, table, out=out, **scales)
    return graph


def test_fp8_decode_graph_replay(seed):
    """Capture once; replay after the lengths, the block table and the descales change."""
    rng = random.Random(seed)
    batch, hkv, d = 8, 8, 128
    k, v, table, seqlens = _replay_cache(rng, batch, hkv, d)
    q = torch.randn(batch, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k_scale, v_scale = torch.ones(1, device="cuda"), torch.ones(1, device="cuda")
    scales = dict(k_descale=k_scale.expand(batch, hkv), v_descale=v_scale.expand(batch, hkv))
    out = torch.empty_like(q)
    graph = _captured_decode(q, k, v, seqlens, table, out, **scales)
    for _ in range(3):
        seqlens.copy_(torch.tensor([rng.randint(1, 4000) for _ in range(batch)], dtype=torch.int32))
        table.copy_(table[torch.randperm(batch, device="cuda")])
        q.copy_(torch.randn_like(q))
        k_scale.fill_(rng.uniform(0.25, 2)), v_scale.fill_(rng.uniform(0.25, 2))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.decode(q, k, v, seqlens, table, **scales)[0]
        assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"fp8 graph replay seed={seed}")


def test_fp8_decode_on_the_prefill_kernel(seed):
    """q_len x group > 64 rows: decode runs on the paged prefill kernel, over the dequantized scratch cache."""
    rng = random.Random(seed)
    contexts = [rng.randint(16, 3000) for _ in range(3)]
    case = _decode_case(rng, contexts, 16, 8, 128, 16)
    _check_decode(*case, f"fp8 decode on prefill ctx={contexts} seed={seed}")


# ---- an e4m3 query (vLLM's, quantized per tensor for an fp8 cache): Q K^T in e4m3 on the cache's tiles ---------


def _quantize_query(q, rng, hkv, per="tensor"):
    """q / scale in e4m3 (saturated, as vLLM's scaled_fp8_quant) and its q_descale: a per-tensor scale expanded to
    [batch, kv_heads] as vLLM passes layer._q_scale, or one per (sequence, kv head)."""
    batch, _, hq, _ = q.shape
    if per == "tensor":
        q_descale = torch.tensor([rng.uniform(0.02, 0.5)], device="cuda").expand(batch, hkv)
    else:
        q_descale = torch.rand(batch, hkv, device="cuda") * 0.3 + 0.02
    per_head = q_descale.repeat_interleave(hq // hkv, dim=1)[:, None, :, None]
    return (q.float() / per_head).clamp(-448, 448).to(torch.float8_e4m3fn), q_descale


def _check_fp8_query(q, k, v, seqlens, table, scales, rng, what, per="tensor", **kw):
    """The e4m3 query into a NaN-poisoned out of q's dtype, against the reference on the same e4m3 values (widened
    exactly) with its q_descale."""
    hkv = k.shape[2]
    q8, q_descale = _quantize_query(q, rng, hkv, per)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    _, lse = tk_backend.flash_attn_with_kvcache(q8, k, v, seqlens, table, out=out, return_softmax_lse=True,
                                                q_descale=q_descale, **scales, **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.decode(q8.to(q.dtype), k, v, seqlens, table, q_descale=q_descale, **scales,
                                        **{n: x for n, x in kw.items() if n != "num_splits"})
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=what)
    # Hopper's e4m3 wgmma accumulates with ~13 fraction bits, truncated (test_wgmma_e4m3): a row over one or two keys
    # carries a single score's error into its lse, up to ~6e-3 past rel 1e-3 at D=256 in a model of that rounding
    # (docs/findings/decode.md#decode-fp8-query); a wrong tile or a race moves it by O(1).
    assert_close(lse, ref_lse, rel=1e-3, atol=8e-3, what=what + " lse")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("q_len,group", [(1, 4), (1, 8), (4, 4), (4, 16)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_fp8_query_decode(d, q_len, group, block_size, num_splits, seed):
    rng = random.Random(seed)
    contexts = [rng.choice([q_len, rng.randint(q_len, 400), rng.randint(1000, 9000)]) for _ in range(5)]
    dtype = rng.choice([torch.bfloat16, torch.float16])
    case = _decode_case(rng, contexts, q_len, group, d, block_size, dtype)
    _check_fp8_query(*case, rng, f"fp8 query decode d={d} q_len={q_len} group={group} bs={block_size} "
                     f"splits={num_splits} {dtype} ctx={contexts} seed={seed}", num_splits=num_splits)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window,softcap", [((128, 0), 0.0), ((-1, -1), 20.0)])
def test_fp8_query_decode_window_softcap_scales(d, window, softcap, seed):
    """Windows, softcap and per-(sequence, head) q descales on the e4m3 product."""
    rng = random.Random(seed)
    contexts = [rng.randint(2, 4000) for _ in range(4)]
    case = _decode_case(rng, contexts, 2, 8, d, 32, torch.bfloat16)
    _check_fp8_query(*case, rng, f"fp8 query decode d={d} window={window} softcap={softcap} ctx={contexts} "
                     f"seed={seed}", per="seq", window_size=window, softcap=softcap)


@pytest.mark.parametrize("contexts,width,num_splits", [
    ([5000, 3, 7000, 120], 8192, 8),   # direct
    (_MANY, 8192, 4),                  # self-scheduled
    (_MANY + _MANY[:16], 8192, 1),     # self-scheduled, 128-key tiles
    ([100_000, 17, 1, 900], 131072, 0),  # balanced
    (_MANY, 131072, 0),                # balanced, 128-key tiles
])
def test_fp8_query_decode_modes(contexts, width, num_splits, seed):
    """Every schedule over the e4m3 product, each run twice (the second reuses the schedule), through PagedDecode
    with vLLM's per-tensor scales."""
    rng = random.Random(seed)
    q, k, v, seqlens, table, decode = _planned_step(rng, contexts, width, num_splits)
    hkv = k.shape[2]
    q8, q_descale = _quantize_query(q, rng, hkv)
    scales = {name: _descales("tensor", len(contexts), hkv, rng) for name in ("k_descale", "v_descale")}
    out = torch.full_like(q, float("nan"))
    for _ in range(2):
        decode.run(q8, k, v, out, q_descale=q_descale, **scales)
    torch.cuda.synchronize()
    ref = reference.decode(q8.to(q.dtype), k, v, seqlens, table, q_descale=q_descale, **scales)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"fp8 query decode modes ctx={contexts[:4]} seed={seed}")


def test_fp8_query_decode_widened_where_the_e4m3_product_does_not_run(seed):
    """Head dim 96, sinks, more rows than a tile (the prefill kernel) and no out (bf16): q is widened first."""
    rng = random.Random(seed)
    contexts = [rng.randint(1, 3000) for _ in range(3)]
    _check_fp8_query(*_decode_case(rng, contexts, 1, 8, 96, 16), rng, f"fp8 query d=96 seed={seed}")
    _check_fp8_query(*_decode_case(rng, contexts, 1, 8, 64, 16), rng, f"fp8 query sinks seed={seed}",
                     sinks=torch.randn(16, device="cuda"))
    _check_fp8_query(*_decode_case(rng, contexts, 16, 8, 128, 16), rng, f"fp8 query on prefill seed={seed}")
    q, k, v, seqlens, table, scales = _decode_case(rng, contexts, 1, 4, 128, 16)
    q8, q_descale = _quantize_query(q, rng, 2)
    out = tk_backend.flash_attn_with_kvcache(q8, k, v, seqlens, table, q_descale=q_descale, **scales)
    assert out.dtype == torch.bfloat16
    ref = reference.decode(q8.to(torch.bfloat16), k, v, seqlens, table, q_descale=q_descale, **scales)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"fp8 query, no out seed={seed}")


def test_fp8_query_decode_graph_replay(seed):
    """Capture the e4m3 product once; replay after the lengths, the query and its scale change."""
    rng = random.Random(seed)
    batch, hkv, d = 8, 8, 128
    k, v, table, seqlens = _replay_cache(rng, batch, hkv, d)
    q8 = torch.zeros(batch, 1, 32, d, device="cuda", dtype=torch.float8_e4m3fn)
    q_scale = torch.ones(1, device="cuda")
    scales = dict(q_descale=q_scale.expand(batch, hkv), k_descale=torch.ones(1, device="cuda").expand(batch, hkv))
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device="cuda")
    graph = _captured_decode(q8, k, v, seqlens, table, out, **scales)
    for _ in range(3):
        seqlens.copy_(torch.tensor([rng.randint(1, 4000) for _ in range(batch)], dtype=torch.int32))
        q_scale.fill_(rng.uniform(0.05, 0.5))
        q8.copy_((torch.randn(q8.shape, device="cuda") / q_scale).to(torch.float8_e4m3fn))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.decode(q8.to(torch.bfloat16), k, v, seqlens, table, **scales)[0]
        assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"fp8 query graph replay seed={seed}")


# ---- prefill over a paged fp8 cache (chunked prefill over a prefix cache) -------------------------------------


def _prefill_case(rng, new, contexts, block_size, hkv, hq, d, dtype, descale="seq"):
    k, v, table = _fp8_cache(rng, contexts, block_size, hkv, d)
    q = torch.randn(sum(new), hq, d, device="cuda", dtype=dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32, device="cuda")
    seqused = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    scales = {name: _descales(descale, len(new), hkv, rng) for name in ("k_descale", "v_descale")}
    return q, k, v, cu_q, seqused, table, scales


def _check_prefill(q, k, v, cu_q, seqused, table, scales, new, contexts, what, total_k_bound=0, **kw):
    """total_k_bound > 0 packs the scratch cache to the keys the batch reads (vLLM passes its CPU lengths)."""
    out = torch.full_like(q, float("nan"))
    _, lse = tk_backend.flash_attn_varlen_func(q, k, v, cu_q, None, max(new), max(contexts), causal=True,
                                               block_table=table, seqused_k=seqused, out=out,
                                               return_softmax_lse=True, total_k_bound=total_k_bound, **scales,
                                               **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.attention(q, k, v, cu_q, None, causal=True, block_table=table, seqused_k=seqused,
                                           **scales, **kw)
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=what)
    # The scratch holds k x descale rounded to fp16 (2^-12 relative, where decode folds the descale into the fp32
    # scores): a row over a few keys moves its lse by up to ~3e-3 (a float64 model of that rounding alone).
    assert_close(lse, ref_lse, rel=1e-3, atol=4e-3, what=what + " lse")


@pytest.mark.parametrize("d", [64, 128, 256, 96])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4])
def test_fp8_prefill(d, block_size, group, seed):
    rng = random.Random(seed)
    new = [rng.randint(1, 300) for _ in range(4)]
    contexts = [n + rng.choice([0, rng.randint(1, 2000)]) for n in new]  # a prefix cache behind each chunk
    dtype = rng.choice([torch.bfloat16, torch.float16])
    case = _prefill_case(rng, new, contexts, block_size, 2, 2 * group, d, dtype)
    bound = sum(contexts) if group == 4 else 0
    _check_prefill(*case, new, contexts, f"fp8 prefill d={d} bs={block_size} group={group} {dtype} new={new} "
                   f"ctx={contexts} bound={bound} seed={seed}", total_k_bound=bound)


@pytest.mark.parametrize("window,softcap,sinks", [((100, 0), 0.0, False), ((-1, -1), 25.0, False),
                                                  ((128, 0), 0.0, True)])
def test_fp8_prefill_window_softcap_sinks(window, softcap, sinks, seed):
    rng = random.Random(seed)
    new = [rng.randint(1, 200) for _ in range(3)]
    contexts = [n + rng.randint(0, 1500) for n in new]
    case = _prefill_case(rng, new, contexts, 16, 2, 16, 64, torch.bfloat16, descale="tensor")
    kw = dict(window_size=window, softcap=softcap)
    if sinks:
        kw["sinks"] = torch.randn(16, device="cuda")
    _check_prefill(*case, new, contexts, f"fp8 prefill window={window} softcap={softcap} sinks={sinks} seed={seed}",
                   **kw)


def test_fp8_prefill_shared_prefix_pages_take_each_sequences_descales(seed):
    """Two sequences over the same prefix pages (vLLM's prefix caching) with descales of their own: the scratch
    cache holds a copy per sequence."""
    rng = random.Random(seed)
    new, contexts = [50, 70], [900, 900]
    q, k, v, cu_q, seqused, table, scales = _prefill_case(rng, new, contexts, 16, 2, 8, 128, torch.bfloat16)
    table[1, :40] = table[0, :40]  # the first 640 keys: one set of pages
    _check_prefill(q, k, v, cu_q, seqused, table, scales, new, contexts, f"fp8 shared prefix seed={seed}",
                   total_k_bound=sum(contexts))


def test_fp8_prefill_with_cu_seqlens_k(seed):
    rng = random.Random(seed)
    new, contexts = [10, 200, 1], [300, 200, 1000]
    q, k, v, cu_q, _, table, scales = _prefill_case(rng, new, contexts, 64, 2, 4, 128, torch.float16)
    cu_k = torch.tensor([0] + list(torch.tensor(contexts).cumsum(0)), dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    tk_backend.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(new), max(contexts), causal=True, block_table=table,
                                      out=out, **scales)
    torch.cuda.synchronize()
    ref = reference.attention(q, k, v, cu_q, cu_k, causal=True, block_table=table, **scales)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"fp8 prefill cu_seqlens_k seed={seed}")


def test_fp8_prefill_graph_replay(seed):
    """The scratch cache is allocated from host-known sizes: the prefill captures, and replays with new lengths."""
    rng = random.Random(seed)
    new, max_context = [32, 32, 32], 2048
    q, k, v, cu_q, seqused, table, scales = _prefill_case(rng, new, [max_context] * 3, 16, 2, 8, 128,
                                                          torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, k, v, cu_q, None, max(new), max_context)
    kw = dict(causal=True, block_table=table, seqused_k=seqused, out=out, **scales)
    tk_backend.flash_attn_varlen_func(*args, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk_backend.flash_attn_varlen_func(*args, **kw)
    for _ in range(2):
        seqused.copy_(torch.tensor([rng.randint(32, max_context) for _ in new], dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.attention(q, k, v, cu_q, None, causal=True, block_table=table, seqused_k=seqused,
                                  **scales)[0]
        assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"fp8 prefill graph replay seed={seed}")


def test_fp8_bindings_check_their_arguments():
    """The ops themselves (past the Python validation) refuse bad fp8 arguments before any launch. In a child
    process: one of these calls once killed the interpreter (SIGSEGV at the v_descale shape check, 1d45b6e's
    tree on the H200), and a crash must fail this test, not end the suite."""
    child = multiprocessing.get_context("spawn").Process(target=_binding_checks)
    child.start()
    child.join(300)
    assert child.exitcode == 0, (f"the binding checks exited with {child.exitcode} (a negative code is the signal "
                                 "that killed them; the child's output above says which call)")


def _binding_checks() -> None:
    import faulthandler
    faulthandler.enable()  # a crash prints the Python frame it happened in (the SIGSEGV's call is still unknown)
    assert tk_backend.extension_available()
    kv = (torch.randn(8, 16, 2, 256, device="cuda")).to(torch.float8_e4m3fn)
    k, v = kv[..., :128], kv[..., 128:]
    q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((3,), 20, dtype=torch.int32, device="cuda")
    table = torch.arange(6, dtype=torch.int32, device="cuda").view(3, 2)
    ws = attention.PagedDecode(attention.DecodeWorkspacePool()).plan(
        seqlens, table, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16).workspace
    out, lse = torch.empty_like(q), torch.empty(3, 8, 1, device="cuda")

    def decode(k_cache, v_cache, **descales):
        print(f"attn_decode: {k_cache.dtype} / {v_cache.dtype} caches, descales "
              f"{ {n: (tuple(x.shape), x.dtype) for n, x in descales.items()} }", flush=True)
        try:
            torch.ops.tk.attn_decode(q, k_cache, v_cache, seqlens, table, ws.work_items, ws.cta_start,
                                     ws.partial_out, ws.partial_lse, 256, 64, 0, False, 128, False, 0.1, True, -1, -1,
                                     0.0, None, out, lse, **descales)
        finally:
            print("  returned (or raised)", flush=True)

    scale = torch.ones(3, 2, device="cuda")
    with pytest.raises(RuntimeError, match="e5m2 KV caches are not supported"):
        decode(k.view(torch.float8_e5m2), v.view(torch.float8_e5m2))
    with pytest.raises(RuntimeError, match="k_descale must be float32"):
        decode(k, v, k_descale=scale.half())
    with pytest.raises(RuntimeError, match=r"v_descale must be \[batch, kv_heads\] = \[3, 2\]"):
        decode(k, v, v_descale=scale[:2])
    with pytest.raises(RuntimeError, match="apply to fp8 caches only"):
        decode(k.view(torch.uint8).to(torch.bfloat16), v.view(torch.uint8).to(torch.bfloat16), k_descale=scale)
    with pytest.raises(RuntimeError, match="v_cache must have the dtype of k_cache"):
        decode(k, v.view(torch.uint8))
    cu = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    dense = torch.randn(4, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="fp8 k / v need a paged cache"):
        torch.ops.tk.attn_varlen(q[0, :1].expand(4, 8, 128).contiguous(), dense, dense, cu, cu, None, None, 4, 4,
                                 0.1, True, -1, -1, 0.0, None)
