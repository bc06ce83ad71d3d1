"""Attention input validation, block-table checks and fake (meta) implementations: no GPU needed."""
from __future__ import annotations

import pytest
import torch

import tk_backend
from tk_backend import attention


def _t(*shape, dtype=torch.bfloat16, device="meta"):
    return torch.empty(*shape, dtype=dtype, device=device)


def _i(*shape, dtype=torch.int32, device="meta"):
    return torch.empty(*shape, dtype=dtype, device=device)


def _varlen(**changes):
    args = dict(q=_t(10, 8, 128), k=_t(12, 2, 128), v=_t(12, 2, 128), cu_seqlens_q=_i(3), cu_seqlens_k=_i(3),
                max_seqlen_q=6, max_seqlen_k=7)
    args.update(changes)
    return args


def _paged(**changes):
    kv = _t(20, 16, 2, 256)  # combined K | V cache: k and v are strided halves
    args = _varlen(k=kv[..., :128], v=kv[..., 128:], cu_seqlens_k=None, seqused_k=_i(2), block_table=_i(2, 4),
                   max_seqlen_k=64)
    args.update(changes)
    return args


def _decode(**changes):
    args = dict(q=_t(3, 1, 8, 128), k_cache=_t(20, 16, 2, 128), v_cache=_t(20, 16, 2, 128), cache_seqlens=_i(3),
                block_table=_i(3, 5))
    args.update(changes)
    return args


VARLEN_ERRORS = [
    (_varlen(q=_t(10, 8, 128, dtype=torch.float32)), TypeError, "q must be bfloat16 or float16, got float32"),
    (_varlen(k=_t(12, 2, 128, dtype=torch.float16)), TypeError, "k must have q's dtype"),
    (_varlen(v=_t(12, 2, 128, dtype=torch.float32)), TypeError,
     "v must be bfloat16, float16, float8_e4m3fn or uint8, got float32"),
    (_varlen(q=_t(10, 8, 128, device="cpu")), ValueError, "q must be a CUDA tensor, got device cpu"),
    (_varlen(k=_t(12, 2, 128, device="cpu")), ValueError, "k must be a CUDA tensor, got device cpu"),
    (_varlen(q=_t(10, 1024)), ValueError, r"q must be \[total_q, heads, head_dim\] \(3 dimensions\), got shape \(10, 1024\)"),
    (_varlen(k=_t(1, 12, 2, 128)), ValueError, r"k must be \[total_k, kv_heads, head_dim\] \(3 dimensions\)"),
    (_varlen(q=_t(10, 8, 100), k=_t(12, 2, 100), v=_t(12, 2, 100)), ValueError,
     "head dim must be a multiple of 8 between 8 and 256, got 100"),
    (_varlen(q=_t(10, 8, 264), k=_t(12, 2, 264), v=_t(12, 2, 264)), ValueError,
     "head dim must be a multiple of 8 between 8 and 256, got 264"),
    (_varlen(sinks=_t(8, dtype=torch.float16)), TypeError, "sinks must be float32"),
    (_varlen(sinks=_t(4, dtype=torch.float32)), ValueError, r"sinks must have shape \(8,\)"),
    (_varlen(q=_t(10, 8, 96), k=_t(12, 2, 96), v=_t(12, 2, 96), sinks=_t(8, dtype=torch.float32)), ValueError,
     "attention sinks need head dim 64, 128 or 256, got 96"),
    (_varlen(k=_t(12, 2, 64)), ValueError, r"k head dim must equal q's \(128\), got 64"),
    (_varlen(v=_t(12, 2, 64)), ValueError, r"v head dim must equal q's \(128\), got 64"),
    (_varlen(v=_t(11, 2, 128)), ValueError, r"v must have shape \(12, 2, 128\), got \(11, 2, 128\)"),
    (_varlen(q=_t(10, 6, 128), k=_t(12, 4, 128), v=_t(12, 4, 128)), ValueError,
     r"q's heads \(6\) must be a multiple of k's heads \(4\)"),
    (_varlen(cu_seqlens_q=_i(3, dtype=torch.int64)), TypeError, "cu_seqlens_q must be int32, got int64"),
    (_varlen(cu_seqlens_q=_i(3, 1)), ValueError, r"cu_seqlens_q must be \[batch \+ 1\] \(1 dimensions\)"),
    (_varlen(cu_seqlens_q=_i(1)), ValueError, "cu_seqlens_q must have batch \\+ 1 >= 2 elements, got 1"),
    (_varlen(cu_seqlens_q=_i(3, device="cpu")), ValueError, "cu_seqlens_q must be a CUDA tensor, got device cpu"),
    (_varlen(cu_seqlens_k=_i(4)), ValueError, r"cu_seqlens_k must have shape \(3,\), got \(4,\)"),
    (_varlen(cu_seqlens_k=_i(3, dtype=torch.int64)), TypeError, "cu_seqlens_k must be int32, got int64"),
    (_varlen(cu_seqlens_k=None), ValueError, "cu_seqlens_k may be None only when seqused_k"),
    (_varlen(seqused_k=_i(3)), ValueError, r"seqused_k must have shape \(2,\), got \(3,\)"),
    (_varlen(max_seqlen_q=torch.tensor(6)), TypeError, "max_seqlen_q must be an int, got Tensor"),
    (_varlen(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0, got -1"),
    (_varlen(softmax_scale=0.0), ValueError, "softmax_scale must be a finite number > 0, got 0.0"),
    (_varlen(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite number > 0"),
    (_varlen(causal=1), TypeError, "causal must be a bool, got int"),
    (_varlen(window_size=(-2, 0)), ValueError, r"window_size must be \(left, right\) ints >= -1"),
    (_varlen(window_size=(1, 2, 3)), ValueError, r"window_size must be \(left, right\)"),
    (_varlen(window_size=(1.5, 0)), ValueError, r"window_size must be \(left, right\)"),
    (_varlen(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0 \(0 disables it\), got -1.0"),
    (_varlen(softcap="30"), TypeError, "softcap must be a float, got str"),
    (_varlen(out=_t(10, 8, 64)), ValueError, r"out must have shape \(10, 8, 128\), got \(10, 8, 64\)"),
    (_varlen(out=_t(10, 8, 128, dtype=torch.float16)), TypeError, "out must have q's dtype"),
    (_varlen(out=_t(10, 128, 8).transpose(1, 2)), ValueError, "out must have a contiguous last dimension"),
    # paged
    (_paged(block_table=_i(2, 4, dtype=torch.int64)), TypeError, "block_table must be int32, got int64"),
    (_paged(block_table=_i(3, 4)), ValueError, r"block_table must have shape \(2, max_blocks >= 1\), got \(3, 4\)"),
    (_paged(block_table=_i(8)), ValueError, r"block_table must be \[batch, max_blocks\] \(2 dimensions\)"),
    (_paged(k=_t(12, 2, 128), v=_t(12, 2, 128)), ValueError,
     r"k must be \[num_blocks, block_size, kv_heads, head_dim\] \(4 dimensions\)"),
    (_paged(k=_t(20, 8, 2, 128), v=_t(20, 8, 2, 128)), ValueError,
     r"block size \(k.shape\[1\]\) must be 16, 32, 64, 128 or 256, got 8"),
    (_paged(k=_t(20, 16, 2, 256)[..., ::2]), ValueError, "k must have a contiguous last dimension"),
    (_paged(v=_t(20, 16, 2, 260)[..., :128]), ValueError, r"v must have a contiguous last dimension and 16-byte aligned"),
    (_paged(max_seqlen_k=65), ValueError, r"max_seqlen_k \(65\) exceeds what block_table can address \(4 blocks x 16 = 64"),
    (_paged(total_k_bound=-1), ValueError, r"total_k_bound must be an int >= 0 \(0: no bound\), got -1"),
    (_paged(total_k_bound=3.0), ValueError, r"total_k_bound must be an int >= 0 \(0: no bound\), got 3.0"),
]


@pytest.mark.parametrize("kwargs,exc,match", VARLEN_ERRORS)
def test_varlen_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tk_backend.flash_attn_varlen_func(**kwargs)


def test_varlen_accepts_good_input():
    scale, window, softcap = attention.validate_varlen(**{**_defaults(), **_varlen()})
    assert scale == 128**-0.5 and window == (-1, -1) and softcap == 0.0
    # vLLM's combined K|V cache halves, seqused_k instead of cu_seqlens_k, a window and a cap
    scale, window, softcap = attention.validate_varlen(
        **{**_defaults(), **_paged(softmax_scale=0.1, causal=True, window_size=(128, 0), softcap=30.0)})
    assert scale == 0.1 and window == (128, 0) and softcap == 30.0


def _defaults():
    return dict(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, block_table=None,
                seqused_k=None, out=None)


DENSE_ERRORS = [
    (dict(q=_t(8, 128), k=_t(2, 7, 2, 128), v=_t(2, 7, 2, 128)), ValueError,
     r"q must be \[batch, seqlen_q, heads, head_dim\] \(4 dimensions\), got shape \(8, 128\)"),
    (dict(q=_t(2, 5, 8, 128), k=_t(3, 7, 2, 128), v=_t(3, 7, 2, 128)), ValueError, "k must have q's batch size 2, got 3"),
    (dict(q=_t(2, 5, 8, 128), k=_t(2, 7, 2, 128), v=_t(2, 6, 2, 128)), ValueError, r"v must have shape \(2, 7, 2, 128\)"),
    (dict(q=_t(2, 0, 8, 128), k=_t(2, 7, 2, 128), v=_t(2, 7, 2, 128)), ValueError, "seqlen_q and seqlen_k >= 1"),
    (dict(q=_t(2, 5, 8, 20), k=_t(2, 7, 2, 20), v=_t(2, 7, 2, 20)), ValueError,
     "head dim must be a multiple of 8 between 8 and 256, got 20"),
    (dict(q=_t(2, 5, 8, 128), k=_t(2, 7, 2, 128), v=_t(2, 7, 2, 128), out=_t(2, 5, 8, 64)), ValueError,
     r"out must have shape \(2, 5, 8, 128\)"),
]


@pytest.mark.parametrize("kwargs,exc,match", DENSE_ERRORS)
def test_dense_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tk_backend.flash_attn_func(**kwargs)


DECODE_ERRORS = [
    (_decode(q=_t(3, 1, 8, 128, dtype=torch.float32)), TypeError, "q must be bfloat16 or float16, got float32"),
    (_decode(v_cache=_t(20, 16, 2, 128, dtype=torch.float16)), TypeError, "v_cache must have q's dtype"),
    (_decode(q=_t(3, 8, 128)), ValueError, r"q must be \[batch, q_len, heads, head_dim\] \(4 dimensions\)"),
    (_decode(q=_t(3, 17, 8, 128)), ValueError, r"q_len \(q.shape\[1\]\) must be between 1 and 16, got 17"),
    (_decode(q=_t(3, 0, 8, 128)), ValueError, r"q_len \(q.shape\[1\]\) must be between 1 and 16, got 0"),
    (_decode(q=_t(3, 1, 8, 100)), ValueError, "head dim must be a multiple of 8 between 8 and 256, got 100"),
    (_decode(sinks=_t(3, dtype=torch.float32)), ValueError, r"sinks must have shape \(8,\)"),
    (_decode(q=_t(3, 1, 3, 128)), ValueError, r"q's heads \(3\) must be a multiple of k_cache's heads \(2\)"),
    (_decode(k_cache=_t(20, 16, 256)), ValueError, r"k_cache must be \[num_blocks, block_size, kv_heads, head_dim\]"),
    (_decode(k_cache=_t(20, 8, 2, 128), v_cache=_t(20, 8, 2, 128)), ValueError,
     r"block size \(k_cache.shape\[1\]\) must be 16, 32, 64, 128 or 256, got 8"),
    (_decode(k_cache=_t(20, 16, 2, 256)[..., 1::2]), ValueError, "k_cache must have a contiguous last dimension"),
    (_decode(cache_seqlens=_i(3, dtype=torch.int64)), TypeError, "cache_seqlens must be int32, got int64"),
    (_decode(cache_seqlens=_i(4)), ValueError, r"cache_seqlens must have shape \(3,\), got \(4,\)"),
    (_decode(cache_seqlens=_i(3, device="cpu")), ValueError, "cache_seqlens must be a CUDA tensor, got device cpu"),
    (_decode(block_table=None), ValueError, "block_table is required"),
    (_decode(block_table=_i(2, 5)), ValueError, r"block_table must have shape \(3, max_blocks >= 1\), got \(2, 5\)"),
    (_decode(block_table=_i(3, 5, dtype=torch.int64)), TypeError, "block_table must be int32, got int64"),
    (_decode(num_splits=-1), ValueError, "num_splits must be >= 0, got -1"),
    (_decode(num_splits=2.0), TypeError, "num_splits must be an int, got float"),
    (_decode(out=_t(3, 2, 8, 128)), ValueError, r"out must have shape \(3, 1, 8, 128\), got \(3, 2, 8, 128\)"),
    (_decode(window_size=(4, -3)), ValueError, r"window_size must be \(left, right\)"),
]


@pytest.mark.parametrize("kwargs,exc,match", DECODE_ERRORS)
def test_decode_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tk_backend.flash_attn_with_kvcache(**kwargs)


def test_decode_accepts_good_input():
    kv = _t(20, 64, 2, 256)
    scale, window, softcap = attention.validate_decode(
        **_decode(q=_t(3, 16, 8, 128), k_cache=kv[..., :128], v_cache=kv[..., 128:]), softmax_scale=None,
        causal=True, window_size=(1024, -1), softcap=50.0, num_splits=0, out=_t(3, 16, 8, 128))
    assert scale == 128**-0.5 and window == (1024, -1) and softcap == 50.0


def test_fake_shapes():
    q, k, v = _t(10, 8, 128), _t(12, 2, 128), _t(12, 2, 128)
    out, lse = torch.ops.tk.attn_varlen(q, k, v, _i(3), _i(3), None, None, 6, 7, 0.1, True, -1, 0, 0.0, None)
    assert out.shape == (10, 8, 128) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (8, 10) and lse.dtype == torch.float32
    kv = _t(20, 16, 2, 256)
    torch.ops.tk.attn_varlen_out(q, kv[..., :128], kv[..., 128:], _i(3), None, _i(2), _i(2, 4), 6, 64, 0.1, False,
                                 -1, -1, 0.0, _t(8, dtype=torch.float32), _t(10, 8, 128), _t(8, 10, dtype=torch.float32))
    torch.ops.tk.attn_decode(
        _t(3, 1, 8, 128), kv[..., :128], kv[..., 128:], _i(3), _i(3, 4), _i(30, 4), _i(133),
        _t(30, 1, 4, 128, dtype=torch.float32), _t(30, 1, 4, dtype=torch.float32), 256, 64, 0, False, 128, False,
        0.1, True, -1, 0, 0.0, None, _t(3, 1, 8, 128), _t(3, 8, 1, dtype=torch.float32))


# ------------------------------------------------------------------------------------------ block table


def test_check_block_table_reads_only_used_pages():
    table = torch.tensor([[3, 1, -1, 99], [0, 2, 7, 5]], dtype=torch.int32)  # garbage past each sequence's pages
    attention.check_block_table(table, torch.tensor([20, 64], dtype=torch.int32), num_blocks=8, block_size=16)
    attention.check_block_table(table, torch.tensor([0, 1], dtype=torch.int32), num_blocks=8, block_size=16)


def test_check_block_table_rejects_out_of_range_pages():
    table = torch.tensor([[3, 1, -1, 99], [0, 2, 7, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = -1 is out of range for a cache of 8 blocks"):
        attention.check_block_table(table, torch.tensor([33, 1], dtype=torch.int32), num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = 7 is out of range for a cache of 7 blocks"):
        attention.check_block_table(table, torch.tensor([1, 64], dtype=torch.int32), num_blocks=7, block_size=16)
    with pytest.raises(ValueError, match="sequence 1 has 65 keys, 5 pages, but block_table has only 4 columns"):
        attention.check_block_table(table, torch.tensor([1, 65], dtype=torch.int32), num_blocks=8, block_size=16)


def test_block_table_debug_check_is_opt_in(monkeypatch):
    table = torch.tensor([[-1]], dtype=torch.int32)
    monkeypatch.delenv("TK_CHECK_BLOCK_TABLE", raising=False)
    assert not attention._block_table_check_wanted(table)  # off by default: it syncs
    monkeypatch.setenv("TK_CHECK_BLOCK_TABLE", "1")
    assert attention._block_table_check_wanted(table)
    assert not attention._block_table_check_wanted(table.to("meta"))  # no data to read


# ---------------------------------------------------------------------------------- the launch path on meta


@pytest.fixture
def stubbed_kernels(monkeypatch):
    """Run the public functions past require_kernels on meta tensors: the fake implementations stand in."""
    monkeypatch.setattr(attention, "require_kernels", lambda t: None)
    monkeypatch.setattr(attention, "_device_info", lambda device: (132, "NVIDIA H200"))


def test_public_functions_reach_the_ops_with_the_right_shapes(stubbed_kernels):
    out, lse = tk_backend.flash_attn_varlen_func(**_varlen(), causal=True, return_softmax_lse=True)
    assert out.shape == (10, 8, 128) and lse.shape == (8, 10)
    out = tk_backend.flash_attn_varlen_func(**_paged(), out=_t(10, 8, 128))
    assert out.shape == (10, 8, 128)
    out, lse = tk_backend.flash_attn_func(_t(2, 5, 8, 128), _t(2, 7, 2, 128), _t(2, 7, 2, 128), return_softmax_lse=True)
    assert out.shape == (2, 5, 8, 128) and lse.shape == (2, 8, 5)
    kv = _t(20, 16, 2, 256)
    out, lse = tk_backend.flash_attn_with_kvcache(
        **_decode(q=_t(3, 2, 8, 128), k_cache=kv[..., :128], v_cache=kv[..., 128:]), window_size=(64, -1),
        return_softmax_lse=True)
    assert out.shape == (3, 2, 8, 128) and lse.shape == (3, 8, 2)


# ------------------------------------------------------------------------------------------ FP8 KV caches

F8 = torch.float8_e4m3fn


def _f8(*shape, dtype=F8, device="meta"):
    return _t(*shape, dtype=dtype, device=device)


def _fp8_decode(**changes):
    kv = _f8(20, 16, 2, 256)  # vLLM's combined K|V cache
    args = _decode(k_cache=kv[..., :128], v_cache=kv[..., 128:], k_descale=_t(3, 2, dtype=torch.float32),
                   v_descale=_t(1, dtype=torch.float32).expand(3, 2))
    args.update(changes)
    return args


def _fp8_paged(**changes):
    kv = _f8(20, 16, 2, 256)
    args = _paged(k=kv[..., :128], v=kv[..., 128:], k_descale=_t(2, 2, dtype=torch.float32))
    args.update(changes)
    return args


FP8_ERRORS = [
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(k_cache=_f8(20, 16, 2, 128, dtype=torch.float8_e5m2)),
     TypeError, r"k_cache is float8_e5m2: e5m2 KV caches are not supported \(FA3 refuses them too\); use "
                "float8_e4m3fn"),
    (tk_backend.flash_attn_varlen_func, _fp8_paged(v=_f8(20, 16, 2, 128, dtype=torch.float8_e5m2)), TypeError,
     "v is float8_e5m2: e5m2 KV caches are not supported"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(v_cache=_t(20, 16, 2, 128)), TypeError,
     "v_cache must have k_cache's dtype torch.float8_e4m3fn, got torch.bfloat16"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(v_cache=_f8(20, 16, 2, 128, dtype=torch.uint8)), TypeError,
     "v_cache must have k_cache's dtype torch.float8_e4m3fn, got torch.uint8"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(k_cache=_f8(20, 16, 2, 128, device="cpu")), ValueError,
     "k_cache must be a CUDA tensor, got device cpu"),
    (tk_backend.flash_attn_with_kvcache,
     _fp8_decode(q=_t(3, 1, 8, 72), k_cache=_f8(20, 16, 2, 72), v_cache=_f8(20, 16, 2, 72)), ValueError,
     "fp8 caches need a head dim that is a multiple of 16, got 72"),
    (tk_backend.flash_attn_varlen_func, _varlen(k=_f8(12, 2, 128), v=_f8(12, 2, 128)), ValueError,
     r"fp8 k / v need a paged cache \(block_table\)"),
    (tk_backend.flash_attn_with_kvcache, _decode(k_descale=_t(3, 2, dtype=torch.float32)), ValueError,
     "q_descale / k_descale / v_descale apply to fp8 caches only, got k_cache of dtype bfloat16"),
    (tk_backend.flash_attn_varlen_func, _paged(q_descale=_t(2, 2, dtype=torch.float32)), ValueError,
     "q_descale / k_descale / v_descale apply to fp8 caches only, got k of dtype bfloat16"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(k_descale=_t(3, 2, dtype=torch.float16)), TypeError,
     "k_descale must be float32, got float16"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(v_descale=_t(3, dtype=torch.float32)), ValueError,
     r"v_descale must have shape \(3, 2\), got \(3,\)"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(q_descale=_t(3, 8, dtype=torch.float32)), ValueError,
     r"q_descale must have shape \(3, 2\), got \(3, 8\)"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(k_descale=_t(3, 2, dtype=torch.float32, device="cpu")),
     ValueError, "k_descale must be a CUDA tensor, got device cpu"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(k_descale=1.0), TypeError,
     "k_descale must be a torch.Tensor, got float"),
    (tk_backend.flash_attn_varlen_func, _fp8_paged(v_descale=_t(3, 2, dtype=torch.float32)), ValueError,
     r"v_descale must have shape \(2, 2\), got \(3, 2\)"),
    # an e4m3 query (vLLM's, over an fp8 cache): only over fp8 caches, into a 16-bit out
    (tk_backend.flash_attn_with_kvcache, _decode(q=_f8(3, 1, 8, 128)), TypeError,
     "q is float8_e4m3fn: an e4m3 query needs fp8 caches, got k_cache of dtype bfloat16"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(q=_f8(3, 1, 8, 128), out=_f8(3, 1, 8, 128)), TypeError,
     "out must be bfloat16 or float16, got float8_e4m3fn"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(q=_f8(3, 1, 8, 128), out=_t(3, 2, 8, 128)), ValueError,
     r"out must have shape \(3, 1, 8, 128\)"),
    (tk_backend.flash_attn_with_kvcache, _fp8_decode(q=_f8(3, 1, 8, 128, dtype=torch.float8_e5m2)), TypeError,
     "q must be bfloat16 or float16, got float8_e5m2"),
]


@pytest.mark.parametrize("fn,kwargs,exc,match", FP8_ERRORS)
def test_fp8_caches_reject_bad_input(fn, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fn(**kwargs)


def test_fp8_caches_accept_good_input():
    kv = _f8(20, 64, 2, 256, dtype=torch.uint8)  # vLLM's uint8 allocation of an fp8 cache
    attention.validate_decode(
        **_fp8_decode(q=_t(3, 16, 8, 128, dtype=torch.float16), k_cache=kv[..., :128], v_cache=kv[..., 128:],
                      q_descale=_t(3, 2, dtype=torch.float32)),
        softmax_scale=None, causal=True, window_size=(1024, -1), softcap=50.0, num_splits=0, out=None)
    attention.validate_varlen(**{**_defaults(), **_fp8_paged(v_descale=_t(2, 2, dtype=torch.float32))})
    assert attention.is_fp8_cache(kv) and not attention.is_fp8_cache(_t(2))
    for out in (None, _t(3, 1, 8, 128, dtype=torch.float16)):  # an e4m3 query, its output bf16 or out's dtype
        attention.validate_decode(
            **_fp8_decode(q=_f8(3, 1, 8, 128), k_cache=kv[..., :128], v_cache=kv[..., 128:],
                          q_descale=_t(1, dtype=torch.float32).expand(3, 2)),
            softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0, num_splits=0, out=out)


def test_fp8_plan_rejects_e5m2():
    seqlens, table = _i(3), _i(3, 4)
    for dtype, match in [(torch.float8_e5m2, "e5m2 KV caches are not supported"),
                         (torch.float32, "kv_cache_dtype must be None or one of bfloat16, float16, float8_e4m3fn")]:
        with pytest.raises(ValueError, match=match):
            attention.PagedDecode().plan(seqlens, table, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                                         kv_cache_dtype=dtype)


def test_fp8_fake_shapes():
    q, kv = _t(3, 1, 8, 128), _f8(20, 16, 2, 256)
    scale = _t(3, 2, dtype=torch.float32)
    torch.ops.tk.attn_decode(
        q, kv[..., :128], kv[..., 128:], _i(3), _i(3, 4), _i(30, 4), _i(133), _t(30, 1, 4, 128, dtype=torch.float32),
        _t(30, 1, 4, dtype=torch.float32), 256, 64, 0, False, 128, False, 0.1, True, -1, 0, 0.0, None,
        _t(3, 1, 8, 128), _t(3, 8, 1, dtype=torch.float32), None, scale, scale)
    out, lse = torch.ops.tk.attn_varlen(_t(10, 8, 128), kv[..., :128], kv[..., 128:], _i(3), None, _i(2), _i(2, 4), 6,
                                        64, 0.1, True, -1, 0, 0.0, None, k_descale=scale[:2], v_descale=scale[:2])
    assert out.shape == (10, 8, 128) and out.dtype == torch.bfloat16 and lse.shape == (8, 10)


def test_fp8_public_functions_reach_the_ops(stubbed_kernels):
    out = tk_backend.flash_attn_with_kvcache(**_fp8_decode(q=_t(3, 2, 8, 128)), window_size=(64, -1))
    assert out.shape == (3, 2, 8, 128) and out.dtype == torch.bfloat16
    out, lse = tk_backend.flash_attn_varlen_func(**_fp8_paged(), causal=True, return_softmax_lse=True)
    assert out.shape == (10, 8, 128) and lse.shape == (8, 10)
    # more rows than the split kernel's 64: decode on the paged prefill kernel, descales passed on
    out = tk_backend.flash_attn_with_kvcache(**_fp8_decode(q=_t(3, 16, 8, 128)))
    assert out.shape == (3, 16, 8, 128)
    kv = _f8(20, 16, 2, 256)
    decode = attention.PagedDecode(attention.DecodeWorkspacePool()).plan(
        _i(3), _i(3, 5), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, kv_cache_dtype=kv.dtype)
    assert decode.split_plan.kv_dtype == "fp8_e4m3"
    out = decode.run(_t(3, 1, 8, 128), kv[..., :128], kv[..., 128:], q_descale=_t(3, 2, dtype=torch.float32))
    assert out.shape == (3, 1, 8, 128)
