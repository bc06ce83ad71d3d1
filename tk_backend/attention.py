"""Attention with flash-attn's API: varlen (optionally paged) prefill, dense batches, and paged decode (also as
PagedDecode: planned once a step, run per layer).

bf16/fp16 q/k/v, float32 softmax, output in q's dtype, lse in float32 (natural log, -inf for a row that
sees no key). Causal masks and windows are aligned bottom-right, as in flash-attn >= 2.1.

FP8 KV caches (vLLM's --kv-cache-dtype fp8 / fp8_e4m3): paged caches of dtype float8_e4m3fn (or uint8 holding its
bytes) that store x / scale, with flash-attn's k_descale / v_descale: float32 [batch, kv_heads] (a per-tensor scale
expanded, any strides) or None for 1. Attention reads k * k_descale[b, h] and v * v_descale[b, h]. q is never
quantized here: q_descale multiplies q as flash-attn defines it (q * q_descale[b, h]), so a caller whose 16-bit q
is already the query passes None (or ones). Decode also takes q as float8_e4m3fn over an FP8 cache (what vLLM hands
its backends: the query quantized per tensor, with the layer's q scale as q_descale): out is then bf16 (or out's
dtype), and at head dims 64, 128 and 256 without sinks the split kernel computes Q K^T in e4m3 on the cache's own
tiles (elsewhere q is widened to out's dtype first, exactly). Decode dequantizes each K/V tile on chip; prefill (and decode's
prefill-kernel fallback) first dequantizes the batch's pages into an fp16 scratch cache (flash_attn_varlen_func
says how large) and runs in fp16. float8_e5m2 caches are refused, as FA3 refuses them.

Everything here is graph-capturable: validation reads only shapes, dtypes and strides; sequence lengths stay
on the device (max_seqlen_* are host ints supplied by the caller, as in flash-attn). Whether block-table
entries lie in [0, num_blocks) cannot be checked without a host sync, so it is the kernel's input contract;
set TK_CHECK_BLOCK_TABLE=1 to have `check_block_table` verify it (with a sync) before each launch outside
graph capture, for debugging.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from tk_backend import _checks, decode_balanced, decode_plan
from tk_backend._library import lib, require_kernels

# Every head dim vLLM's FLASH_ATTN takes on sm90: multiples of 8 up to 256. Those between the kernels' tiles run on
# the next tile up, its extra columns zero-filled on chip (csrc/kernels/prefill/policy.cuh: ragged_head_dim).
HEAD_DIMS = tuple(range(8, 257, 8))
TILE_HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128, 256)
MAX_DECODE_Q_LEN = 16
MAX_DECODE_ROWS = 64  # query rows a kv head (q_len x q heads per kv head) in the split decode kernel's tile
DECODE_TAKES_E4M3_QUERY = True  # decode over an FP8 cache takes vLLM's e4m3 query (the module docstring)
# The dtypes of FP8 caches: float8_e4m3fn, or uint8 holding its bytes (vLLM allocates its caches as either).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_DESCALES = "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None"

_VARLEN_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_k, "
    "Tensor? block_table, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
    "int window_left, int window_right, float softcap, Tensor? sinks"
)
# q_descale / k_descale / v_descale: the module docstring's FP8 caches (paged k / v only).
# total_k_bound > 0: the caller's bound on the keys summed over sequences, which sizes an FP8 cache's scratch.
lib.define(f"attn_varlen({_VARLEN_ARGS}, {_DESCALES}, int total_k_bound=0) -> (Tensor out, Tensor lse)")
lib.define(
    f"attn_varlen_out({_VARLEN_ARGS}, Tensor(a!) out, Tensor(b!) lse, {_DESCALES}, int total_k_bound=0) -> ()"
)
# Split-KV decode on a DecodeWorkspace: the op fills work_items / cta_start on the device from cache_seqlens
# and the plan's chunk_tokens / item_overhead / coarsen_levels exactly as decode_plan.build_work_list does (each
# CTA of the split kernel works out and writes its own range, or in balanced mode a schedule kernel runs first;
# with reuse_schedule they already hold it, from an earlier run of the same plan),
# then runs the kernel and merges partial_out / partial_lse (see decode_plan's docstring for their layout).
# The kernels are csrc/kernels/decode.cu; PagedDecode.run launches them.
lib.define(
    "attn_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor block_table, "
    "Tensor(a!) work_items, Tensor(b!) cta_start, Tensor(c!) partial_out, Tensor(d!) partial_lse, "
    "int chunk_tokens, int item_overhead, int coarsen_levels, bool balanced, int kv_tile, bool reuse_schedule, "
    "float softmax_scale, "
    "bool causal, int window_left, int window_right, float softcap, Tensor? sinks, Tensor(e!) out, "
    f"Tensor(f!) lse, {_DESCALES}) -> ()"
)


@torch.library.register_fake("tk::attn_varlen")
def _attn_varlen_fake(q, k, v, *args) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.register_fake("tk::attn_varlen_out")
def _attn_varlen_out_fake(*args) -> None:
    return None


@torch.library.register_fake("tk::attn_decode")
def _attn_decode_fake(*args) -> None:
    return None


# ------------------------------------------------------------------------------------------- validation


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _rank(t: torch.Tensor, name: str, layout: str) -> None:
    ndim = layout.count(",") + 1
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {layout} ({ndim} dimensions), got shape {tuple(t.shape)}")


def _half_tensor(t: object, name: str, layout: str) -> torch.Tensor:
    t = _checks.tensor(t, name, dtypes=_checks.HALF_TYPES)
    _rank(t, name, layout)
    return _checks.tensor(t, name)  # device


def _index_tensor(
    t: object, name: str, expected_shape: tuple[int, ...], layout: str, ref: torch.Tensor
) -> torch.Tensor:
    t = _checks.tensor(t, name, dtypes=(torch.int32,))
    _rank(t, name, layout)
    _checks.same_device(t, ref, name, "q")
    _checks.shape(t, name, expected_shape)
    return t


def _addressable(t: torch.Tensor, name: str) -> None:
    if not _checks.tma_ready(t):
        raise ValueError(
            f"{name} must have a contiguous last dimension and 16-byte aligned base and strides, got strides "
            f"{tuple(t.stride())} for {_dtype_name(t.dtype)} shape {tuple(t.shape)}"
        )


def _int(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim must be a multiple of 8 between 8 and 256, got {d}")
    for t, name in ((k, "k"), (v, "v")):
        if t.shape[-1] != d:
            raise ValueError(f"{name} head dim must equal q's ({d}), got {t.shape[-1]}")


def _total_k_bound(bound: object) -> None:
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        raise ValueError(f"total_k_bound must be an int >= 0 (0: no bound), got {bound!r}")


def is_fp8_cache(t: torch.Tensor) -> bool:
    """Whether a cache holds float8_e4m3fn values (as that dtype or as uint8 bytes)."""
    return t.dtype in FP8_CACHE_DTYPES


def _cache_tensor(t: object, name: str, layout: str) -> torch.Tensor:
    """A cache: bf16 / fp16, or (FP8 caches) float8_e4m3fn or uint8; float8_e5m2 gets its reason."""
    if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e5m2:
        raise TypeError(f"{name} is float8_e5m2: e5m2 KV caches are not supported (FA3 refuses them too); use "
                        "float8_e4m3fn")
    t = _checks.tensor(t, name, dtypes=_checks.HALF_TYPES + FP8_CACHE_DTYPES)
    _rank(t, name, layout)
    return _checks.tensor(t, name)  # device


def _kv_like_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str, v_name: str) -> None:
    """k and v: q's dtype and device, or both of one FP8 cache dtype on q's device at a head dim of whole 16-byte
    units (TMA copies their rows)."""
    fp8 = is_fp8_cache(k)
    for t, name in ((k, k_name), (v, v_name)):
        _checks.same_dtype(t, k if fp8 else q, name, k_name if fp8 else "q")
        _checks.same_device(t, q, name, "q")
    _head_dims(q, k, v)
    if fp8 and q.shape[-1] % 16:
        raise ValueError(f"fp8 caches need a head dim that is a multiple of 16, got {q.shape[-1]}")
    _checks.shape(v, v_name, tuple(k.shape))
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of {k_name}'s heads ({hkv})")


def _paged_cache(k: torch.Tensor, v: torch.Tensor, k_name: str, v_name: str) -> int:
    block_size = k.shape[1]
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block size ({k_name}.shape[1]) must be 16, 32, 64, 128 or 256, got {block_size}")
    _addressable(k, k_name)
    _addressable(v, v_name)
    return block_size


def _scale(softmax_scale: object, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    return float(softmax_scale)


def _window(window_size: object) -> tuple[int, int]:
    ok = (
        isinstance(window_size, (tuple, list)) and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    )
    if not ok:
        raise ValueError(f"window_size must be (left, right) ints >= -1 (-1: unbounded), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _softcap(softcap: object) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    return float(softcap)


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _out(out: object, q: torch.Tensor, expected: tuple[int, ...]) -> torch.Tensor:
    """out: q's dtype (an e4m3 q's out: bf16 or fp16), device and the expected shape, addressable."""
    if q.dtype == torch.float8_e4m3fn:
        out = _checks.tensor(out, "out", dtypes=_checks.HALF_TYPES)
    else:
        out = _checks.tensor(out, "out")
        _checks.same_dtype(out, q, "out", "q")
    _checks.same_device(out, q, "out", "q")
    _checks.shape(out, "out", expected)
    _addressable(out, "out")
    return out


def validate_descales(
    q_descale: object, k_descale: object, v_descale: object, k: torch.Tensor, batch: int, ref: torch.Tensor,
    k_name: str = "k",
) -> None:
    """flash-attn's descales: each None or float32 [batch, kv_heads] on ref's device (any strides: a per-tensor
    scale expanded), and only with an FP8 cache k (16-bit caches hold the values themselves)."""
    given = [(t, name) for t, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))
             if t is not None]
    if given and not is_fp8_cache(k):
        raise ValueError(f"q_descale / k_descale / v_descale apply to fp8 caches only, got {k_name} of dtype "
                         f"{_dtype_name(k.dtype)}")
    for t, name in given:
        t = _checks.tensor(t, name, dtypes=(torch.float32,))
        _checks.same_device(t, ref, name, "q")
        _checks.shape(t, name, (batch, k.shape[-2]))


def validate_sinks(sinks: object, q: torch.Tensor) -> torch.Tensor | None:
    """Attention sinks: None, or float32 [q_heads] on q's device (one logit per query head, as vLLM's and FA3's
    s_aux), at head dims 64, 128 and 256."""
    if sinks is None:
        return None
    sinks = _checks.tensor(sinks, "sinks", dtypes=(torch.float32,))
    _checks.same_device(sinks, q, "sinks", "q")
    _checks.shape(sinks, "sinks", (q.shape[-2],))
    if q.shape[-1] not in TILE_HEAD_DIMS:
        raise ValueError(f"attention sinks need head dim 64, 128 or 256, got {q.shape[-1]}")
    return sinks.contiguous()


def check_block_table(block_table: torch.Tensor, seqlens_k: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise if a page a sequence uses is outside [0, num_blocks). Syncs with the device: for debugging only.

    Columns past a sequence's ceil(seqlen / block_size) pages are never read and may hold anything.
    """
    pages_used = (seqlens_k.long() + block_size - 1) // block_size
    too_long = (pages_used > block_table.shape[1]).nonzero()
    if len(too_long):
        b = int(too_long[0, 0])
        raise ValueError(f"sequence {b} has {int(seqlens_k[b])} keys, {int(pages_used[b])} pages, but block_table "
                         f"has only {block_table.shape[1]} columns")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
    bad = (used & ((block_table < 0) | (block_table >= num_blocks))).nonzero()
    if len(bad):
        b, j = (int(x) for x in bad[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is out of range for a cache of "
                         f"{num_blocks} blocks (sequence {b} uses {int(pages_used[b])} pages)")


def _block_table_check_wanted(block_table: torch.Tensor) -> bool:
    """TK_CHECK_BLOCK_TABLE=1 asks for check_block_table, where there is data to read and syncing is legal."""
    if os.environ.get("TK_CHECK_BLOCK_TABLE", "0") in ("", "0") or block_table.device.type == "meta":
        return False
    return not (block_table.is_cuda and torch.cuda.is_current_stream_capturing())


def validate_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
    block_table, seqused_k, out, q_descale=None, k_descale=None, v_descale=None,
) -> tuple[float, tuple[int, int], float]:
    """Check every argument of flash_attn_varlen_func; returns (softmax_scale, window, softcap) resolved."""
    q = _half_tensor(q, "q", "[total_q, heads, head_dim]")
    paged = block_table is not None
    kv_layout = "[num_blocks, block_size, kv_heads, head_dim]" if paged else "[total_k, kv_heads, head_dim]"
    k = _cache_tensor(k, "k", kv_layout)
    v = _cache_tensor(v, "v", kv_layout)
    _kv_like_q(q, k, v, "k", "v")
    if is_fp8_cache(k) and not paged:
        raise ValueError("fp8 k / v need a paged cache (block_table): the dense varlen path takes 16-bit k / v "
                         "(vLLM reads its fp8 caches paged)")

    cu_seqlens_q = _checks.tensor(cu_seqlens_q, "cu_seqlens_q", dtypes=(torch.int32,))
    _rank(cu_seqlens_q, "cu_seqlens_q", "[batch + 1]")
    _checks.same_device(cu_seqlens_q, q, "cu_seqlens_q", "q")
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1:
        raise ValueError(f"cu_seqlens_q must have batch + 1 >= 2 elements, got {batch + 1}")
    if cu_seqlens_k is None and seqused_k is None:
        raise ValueError("cu_seqlens_k may be None only when seqused_k gives the key counts")
    if cu_seqlens_k is not None:
        _index_tensor(cu_seqlens_k, "cu_seqlens_k", (batch + 1,), "[batch + 1]", q)
    if seqused_k is not None:
        _index_tensor(seqused_k, "seqused_k", (batch,), "[batch]", q)
    max_seqlen_q = _int(max_seqlen_q, "max_seqlen_q", 0)
    max_seqlen_k = _int(max_seqlen_k, "max_seqlen_k", 0)
    if paged:
        block_table = _checks.tensor(block_table, "block_table", dtypes=(torch.int32,))
        _rank(block_table, "block_table", "[batch, max_blocks]")
        _checks.same_device(block_table, q, "block_table", "q")
        if block_table.shape[0] != batch or block_table.shape[1] < 1:
            raise ValueError(f"block_table must have shape ({batch}, max_blocks >= 1), got {tuple(block_table.shape)}")
        block_size = _paged_cache(k, v, "k", "v")
        capacity = block_table.shape[1] * block_size
        if max_seqlen_k > capacity:
            raise ValueError(f"max_seqlen_k ({max_seqlen_k}) exceeds what block_table can address "
                             f"({block_table.shape[1]} blocks x {block_size} = {capacity} keys)")
    if out is not None:
        _out(out, q, (q.shape[0], q.shape[1], v.shape[-1]))
    validate_descales(q_descale, k_descale, v_descale, k, batch, q)
    _bool(causal, "causal")
    return _scale(softmax_scale, q.shape[-1]), _window(window_size), _softcap(softcap)


def validate_dense(q, k, v, softmax_scale, causal, window_size, softcap, out) -> tuple[float, tuple[int, int], float]:
    """Check every argument of flash_attn_func; returns (softmax_scale, window, softcap) resolved."""
    q = _half_tensor(q, "q", "[batch, seqlen_q, heads, head_dim]")
    k = _half_tensor(k, "k", "[batch, seqlen_k, kv_heads, head_dim]")
    v = _half_tensor(v, "v", "[batch, seqlen_k, kv_heads, head_dim]")
    _kv_like_q(q, k, v, "k", "v")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have q's batch size {q.shape[0]}, got {k.shape[0]}")
    if min(q.shape[0], q.shape[1], k.shape[1]) < 1:
        raise ValueError(f"flash_attn_func needs batch, seqlen_q and seqlen_k >= 1, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if out is not None:
        out = _checks.tensor(out, "out")
        _checks.same_dtype(out, q, "out", "q")
        _checks.same_device(out, q, "out", "q")
        _checks.shape(out, "out", tuple(q.shape))
    _bool(causal, "causal")
    return _scale(softmax_scale, q.shape[-1]), _window(window_size), _softcap(softcap)


def _decode_block_table(block_table: object, batch: int, ref: torch.Tensor, ref_name: str) -> None:
    if block_table is None:
        raise ValueError(
            "block_table is required: decode reads paged caches [num_blocks, block_size, kv_heads, head_dim]"
        )
    block_table = _checks.tensor(block_table, "block_table", dtypes=(torch.int32,))
    _rank(block_table, "block_table", "[batch, max_blocks]")
    _checks.same_device(block_table, ref, "block_table", ref_name)
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape ({batch}, max_blocks >= 1), got {tuple(block_table.shape)}")


def validate_decode(
    q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap, num_splits, out,
    q_descale=None, k_descale=None, v_descale=None,
) -> tuple[float, tuple[int, int], float]:
    """Check every argument of flash_attn_with_kvcache; returns (softmax_scale, window, softcap) resolved."""
    layout = "[num_blocks, block_size, kv_heads, head_dim]"
    fp8_query = isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn  # the module docstring's e4m3 query
    if fp8_query:
        q = _checks.tensor(q, "q")
        _rank(q, "q", "[batch, q_len, heads, head_dim]")
    else:
        q = _half_tensor(q, "q", "[batch, q_len, heads, head_dim]")
    k_cache = _cache_tensor(k_cache, "k_cache", layout)
    v_cache = _cache_tensor(v_cache, "v_cache", layout)
    if fp8_query and not is_fp8_cache(k_cache):
        raise TypeError(f"q is float8_e4m3fn: an e4m3 query needs fp8 caches, got k_cache of dtype "
                        f"{_dtype_name(k_cache.dtype)}")
    _kv_like_q(q, k_cache, v_cache, "k_cache", "v_cache")
    batch, q_len = q.shape[0], q.shape[1]
    if batch < 1:
        raise ValueError(f"q must have batch >= 1, got {batch}")
    if not 1 <= q_len <= MAX_DECODE_Q_LEN:
        raise ValueError(f"q_len (q.shape[1]) must be between 1 and {MAX_DECODE_Q_LEN}, got {q_len}")
    _index_tensor(cache_seqlens, "cache_seqlens", (batch,), "[batch]", q)
    _decode_block_table(block_table, batch, q, "q")
    _paged_cache(k_cache, v_cache, "k_cache", "v_cache")
    _int(num_splits, "num_splits", 0)
    if out is not None:
        _out(out, q, tuple(q.shape))
    validate_descales(q_descale, k_descale, v_descale, k_cache, batch, q, "k_cache")
    _bool(causal, "causal")
    return _scale(softmax_scale, q.shape[-1]), _window(window_size), _softcap(softcap)


def validate_decode_plan(
    cache_seqlens, block_table, num_q_heads, num_kv_heads, head_dim, page_size, q_len, causal, window_size,
    num_splits, kv_cache_dtype=None,
) -> tuple[int, int]:
    """Check every argument of PagedDecode.plan; returns the window resolved."""
    seqlens = _checks.tensor(cache_seqlens, "cache_seqlens", dtypes=(torch.int32,))
    _rank(seqlens, "cache_seqlens", "[batch]")
    if seqlens.shape[0] < 1:
        raise ValueError(f"cache_seqlens must hold batch >= 1 lengths, got shape {tuple(seqlens.shape)}")
    _decode_block_table(block_table, seqlens.shape[0], seqlens, "cache_seqlens")
    if not 1 <= _int(q_len, "q_len", 1) <= MAX_DECODE_Q_LEN:
        raise ValueError(f"q_len must be between 1 and {MAX_DECODE_Q_LEN}, got {q_len}")
    hq, hkv = _int(num_q_heads, "num_q_heads", 1), _int(num_kv_heads, "num_kv_heads", 1)
    if hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if _int(head_dim, "head_dim", 1) not in HEAD_DIMS:
        raise ValueError(f"head_dim must be a multiple of 8 between 8 and 256, got {head_dim}")
    if _int(page_size, "page_size", 1) not in BLOCK_SIZES:
        raise ValueError(f"page_size must be 16, 32, 64, 128 or 256, got {page_size}")
    _int(num_splits, "num_splits", 0)
    cache_dtypes = _checks.HALF_TYPES + FP8_CACHE_DTYPES
    if kv_cache_dtype == torch.float8_e5m2:
        raise ValueError("kv_cache_dtype float8_e5m2: e5m2 KV caches are not supported (FA3 refuses them too); use "
                         "float8_e4m3fn")
    if kv_cache_dtype is not None and kv_cache_dtype not in cache_dtypes:
        raise ValueError(f"kv_cache_dtype must be None or one of {', '.join(map(_dtype_name, cache_dtypes))}, got "
                         f"{kv_cache_dtype!r}")
    _bool(causal, "causal")
    return _window(window_size)


# ------------------------------------------------------------------------------------------- public API


def _addressable_copy(t: torch.Tensor) -> torch.Tensor:
    """t itself if the copy engine can read it, else a contiguous copy (cheap next to attention on it)."""
    return t if _checks.tma_ready(t) else t.contiguous()


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
            scale, causal, window, softcap, out, sinks=None, descales=(None, None, None), total_k_bound=0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on validated inputs; descales: (q_descale, k_descale, v_descale) of an FP8 cache."""
    q = _addressable_copy(q)
    if block_table is None:
        k, v = _addressable_copy(k), _addressable_copy(v)
    elif _block_table_check_wanted(block_table):
        seqlens = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        check_block_table(block_table, seqlens, k.shape[0], k.shape[1])
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
            scale, causal, window[0], window[1], softcap, sinks)
    if out is None:
        return torch.ops.tk.attn_varlen(*args, *descales, total_k_bound)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    torch.ops.tk.attn_varlen_out(*args, out, lse, *descales, total_k_bound)
    return out, lse


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    total_k_bound: int = 0,
):
    """Attention over packed variable-length sequences: q [total_q, Hq, D] -> out [total_q, Hq, D].

    k/v are [total_k, Hkv, D], or paged caches [num_blocks, block_size, Hkv, D] (any strides with a unit last
    one, e.g. halves of a combined K|V cache) addressed through block_table [batch, max_blocks]. Sequence b's
    keys number seqused_k[b] if given, else cu_seqlens_k[b+1] - cu_seqlens_k[b] (cu_seqlens_k may be None
    with seqused_k, as vLLM calls it). max_seqlen_q/k must bound the true lengths (they size the grid).
    sinks [Hq] float32 (attention sinks, vLLM's / FA3's s_aux): a logit per query head that joins every row's
    softmax denominator and attends to nothing; the lse then includes it. Head dims: multiples of 8 up to 256.
    Paged k / v may be FP8 caches (float8_e4m3fn or uint8, head dims multiples of 16) with q_descale / k_descale /
    v_descale float32 [batch, Hkv] or None (the module docstring's FP8 caches): the pages the batch reads are
    dequantized into an fp16 scratch cache first (and the kernel runs in fp16), of batch x ceil(max_seqlen_k /
    block_size) pages, or fewer with total_k_bound > 0, a host-known bound on the keys summed over sequences
    (vLLM's CPU sequence lengths): pass it where one long sequence shares a batch with many short ones.
    Returns out, or (out, lse [Hq, total_q] float32) with return_softmax_lse.
    """
    scale, window, softcap = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
        softcap, block_table, seqused_k, out, q_descale, k_descale, v_descale,
    )
    sinks = validate_sinks(sinks, q)
    _total_k_bound(total_k_bound)
    require_kernels(q)
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                       scale, causal, window, softcap, out, sinks, (q_descale, k_descale, v_descale), total_k_bound)
    return (out, lse) if return_softmax_lse else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Attention over a batch of equal-length sequences: q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D] -> [B, Nq, Hq, D].

    sinks as in flash_attn_varlen_func. Returns out, or (out, lse [B, Hq, Nq] float32) with return_softmax_lse.
    """
    scale, window, softcap = validate_dense(q, k, v, softmax_scale, causal, window_size, softcap, out)
    sinks = validate_sinks(sinks, q)
    require_kernels(q)
    bsz, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    cu_q = torch.arange(0, (bsz + 1) * nq, nq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (bsz + 1) * nk, nk, dtype=torch.int32, device=q.device)
    flat_out = out.view(bsz * nq, hq, d) if out is not None and out.is_contiguous() else None
    o, lse = _varlen(q.reshape(bsz * nq, hq, d), k.reshape(bsz * nk, hkv, d), v.reshape(bsz * nk, hkv, d),
                     cu_q, cu_k, None, None, nq, nk, scale, causal, window, softcap, flat_out, sinks)
    if out is not None and flat_out is None:
        out.copy_(o.view(bsz, nq, hq, d))
    o = out if out is not None else o.view(bsz, nq, hq, d)
    return (o, lse.view(hq, bsz, nq).transpose(0, 1)) if return_softmax_lse else o


@functools.lru_cache(maxsize=None)
def _device_properties(index: int) -> tuple[int, str]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.name


def _device_info(device: torch.device) -> tuple[int, str]:
    """(SM count, name) of a CUDA device, queried once: the persistent grid and the config table depend on it."""
    return _device_properties(device.index if device.index is not None else torch.cuda.current_device())


# ------------------------------------------------------------------------------------------- paged decode


@dataclasses.dataclass(eq=False)
class PooledWorkspace:
    """One buffer set of a DecodeWorkspacePool, and whose schedule its work list holds."""

    buffers: decode_plan.DecodeWorkspace
    schedule: tuple[object, bool] | None = None  # (plan, captured) of the last run on it: PagedDecode._claim_schedule


class DecodeWorkspacePool:
    """Decode workspaces: one buffer set per (device, row layout, CTA count), shared by every plan of that layout
    (a plan takes a prefix of it), so that vLLM's mixed batches, any number of decode requests each, do not add a
    buffer each. A set is allocated on first use and grows by doubling; outgrown sets stay alive, since a captured
    CUDA graph may still point at them. Its plans run on one stream, one launch sequence after another."""

    def __init__(self) -> None:
        self._held: dict[tuple, list[PooledWorkspace]] = {}

    def acquire(self, plan: decode_plan.DecodePlan, device: torch.device, items: int | None = None
                ) -> PooledWorkspace:
        """The newest buffer set of plan's row layout, grown to hold `items` rows (default: the plan's max_items)."""
        items = plan.max_items if items is None else items
        held = self._held.setdefault((device, plan.q_len, plan.group, plan.head_dim, plan.num_ctas), [])
        if not held or held[-1].buffers.capacity < items:
            capacity = max(items, 2 * held[-1].buffers.capacity if held else 0)
            held.append(PooledWorkspace(decode_plan.DecodeWorkspace.allocate(plan, device, capacity, needed=items)))
        return held[-1]

    def held(self) -> list[list[PooledWorkspace]]:
        """Every layout's buffer sets, oldest first."""
        return list(self._held.values())

    def clear(self) -> None:
        """Drop every buffer set (only when no captured graph uses them)."""
        self._held.clear()


# The pool of PagedDecode objects given none, flash_attn_with_kvcache's among them.
DEFAULT_DECODE_WORKSPACES = DecodeWorkspacePool()

# Balanced mode pays where the static work list is mostly empty slots (a block table far wider than the contexts,
# or one long sequence): plans of many splits (docs/findings/decode.md#decode-balanced2).
BALANCED_MIN_SPLITS = 16


def balanced_mode(plan: decode_plan.DecodePlan, num_splits: int = 0) -> bool:
    """Whether the planner's `plan` runs in balanced mode (decode_balanced): where the static plan would schedule
    (more slots than CTAs) with at least BALANCED_MIN_SPLITS splits a sequence, and num_splits does not force the
    split. A plan of few splits already gives CTAs whole items, and a one-split plan needs no merge."""
    return (plan.max_items > plan.num_ctas and plan.max_splits >= BALANCED_MIN_SPLITS and num_splits <= 0
            and plan.num_ctas <= decode_balanced.MAX_CTAS)


class PagedDecode:
    """Paged decode planned once per step and run per layer, as FlashInfer's BatchDecodeWithPagedKVCacheWrapper:
    flash_attn_with_kvcache in two halves.

        decode = PagedDecode().plan(cache_seqlens, block_table, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                    page_size=16)
        for q, k_cache, v_cache, out in layers:
            decode.run(q, k_cache, v_cache, out)

    plan() is host work only (no sync): from the shapes (and the caches' dtype: an FP8 cache's tokens cost half the
    bytes) it picks the split-KV plan (decode_plan.make_plan: the KV chunk and the most splits a sequence can have,
    for the block table's width), whether it runs in balanced mode,
    the kernel's K/V tile, and the workspace it runs on (from a DecodeWorkspacePool); a group of q_len x
    (q heads per kv head) > 64 rows runs on the paged prefill kernel instead. The lengths stay on the device.

    The kernel's first run after plan() works out the step's schedule (which CTA attends which keys) from the
    lengths, into the workspace; later runs reuse it, so the lengths must not change between a plan's runs (plan
    again for a new step). A run reuses it only when the workspace's last run was one of this plan in the same mode
    of execution: another plan of the same row layout shares the pool's buffers, and a run captured into a CUDA
    graph does not execute at capture, so an eager run may not reuse what a captured run would have written, nor a
    captured run an eager one's (vLLM warms up and captures with the same metadata).
    """

    def __init__(self, workspaces: DecodeWorkspacePool | None = None) -> None:
        self.workspaces = DEFAULT_DECODE_WORKSPACES if workspaces is None else workspaces
        # What plan() fixes:
        self.cache_seqlens: torch.Tensor | None = None  # None until planned
        self.block_table: torch.Tensor | None = None
        self.q_shape = (0, 0, 0, 0)  # (batch, q_len, q heads, head dim)
        self.num_kv_heads = self.page_size = 0
        self.causal, self.window, self.num_splits = True, (-1, -1), 0
        self.split_plan: decode_plan.DecodePlan | None = None  # None: the paged prefill kernel runs the step
        self.balanced = False
        self.kv_tile = 128
        self.workspace: decode_plan.DecodeWorkspace | None = None  # the plan's prefix of the pool's buffers
        self._pooled: PooledWorkspace | None = None
        self._schedule_id = object()  # a fresh one each plan(): whose schedule the pool's buffers hold

    def plan(
        self,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        q_len: int = 1,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        num_splits: int = 0,
        split_plan: decode_plan.DecodePlan | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        total_k_bound: int = 0,
    ) -> "PagedDecode":
        """Plan the step of cache_seqlens [batch] (int32, on the device) over block_table [batch, max_blocks]
        (its width bounds every context); num_splits > 0 forces the split count, as in flash-attn. split_plan runs a
        DecodePlan of these shapes as given, in the static schedule (scripts/tune.py times chunks with it).
        kv_cache_dtype: the caches' dtype (None: 16-bit; an FP8 one plans for 1-byte tokens). total_k_bound > 0: a
        host-known bound on sum(cache_seqlens), which sizes an FP8 cache's scratch where the step runs on the
        prefill kernel (flash_attn_varlen_func). Returns self."""
        window = validate_decode_plan(cache_seqlens, block_table, num_q_heads, num_kv_heads, head_dim, page_size,
                                      q_len, causal, window_size, num_splits, kv_cache_dtype)
        _total_k_bound(total_k_bound)
        if split_plan is not None:
            _check_split_plan(split_plan, block_table.shape[0], block_table.shape[1] * page_size, q_len, num_q_heads,
                              num_kv_heads, head_dim, page_size, window[0])
        return self._plan(cache_seqlens, block_table, num_q_heads, num_kv_heads, head_dim, page_size, q_len, causal,
                          window, num_splits, split_plan, kv_cache_dtype, total_k_bound)

    def _plan(self, cache_seqlens, block_table, num_q_heads, num_kv_heads, head_dim, page_size, q_len, causal,
              window, num_splits, split_plan=None, kv_cache_dtype=None, total_k_bound=0) -> "PagedDecode":
        """plan() on validated arguments."""
        batch, width = block_table.shape
        # More rows per kv head than the split kernel's 64-row tile (or TK_DECODE_KERNEL=prefill, a debugging
        # fallback): no plan, the paged prefill kernel runs the step.
        split_kernel = (q_len * (num_q_heads // num_kv_heads) <= MAX_DECODE_ROWS
                        and os.environ.get("TK_DECODE_KERNEL") != "prefill")
        plan = split_plan
        if plan is None and split_kernel:
            num_sms, device_name = _device_info(cache_seqlens.device)
            kv_dtype = decode_plan.kv_dtype_of(kv_cache_dtype)
            plan = decode_plan.make_plan(batch, width * page_size, q_len, num_q_heads, num_kv_heads, head_dim,
                                         page_size, num_sms, window[0], num_splits, device_name, kv_dtype)
        self.cache_seqlens, self.block_table = cache_seqlens, block_table
        self.q_shape = (batch, q_len, num_q_heads, head_dim)
        self.num_kv_heads, self.page_size = num_kv_heads, page_size
        self.causal, self.window, self.num_splits = causal, window, num_splits
        self.total_k_bound = total_k_bound
        self.split_plan = plan
        self.balanced = plan is not None and split_plan is None and balanced_mode(plan, num_splits)
        self.kv_tile = decode_plan.kv_tile(plan, self.balanced) if plan is not None else 128
        if plan is None:
            self._pooled = self.workspace = None
        else:  # balanced mode: two partial slots a CTA (and the stream offsets), whatever the table's width
            items = decode_balanced.workspace_items(batch, plan.num_ctas) if self.balanced else plan.max_items
            self._pooled = self.workspaces.acquire(plan, cache_seqlens.device, items)
            self.workspace = self._pooled.buffers.prefix(items)
        self._schedule_id = object()  # a new schedule: the next run works it out
        return self

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        block_table: torch.Tensor | None = None,
        return_softmax_lse: bool = False,
        sinks: torch.Tensor | None = None,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
    ):
        """One layer: q [batch, q_len, Hq, D] against caches [num_blocks, page_size, Hkv, D] (the new tokens already
        written), over the planned lengths and block table. block_table replaces the planned one by another of its
        shape (another KV-cache group's pages of the same requests: the schedule depends on the table's width, not
        its pages). sinks: the layer's attention sinks (flash_attn_varlen_func). FP8 caches take q_descale /
        k_descale / v_descale (flash_attn_with_kvcache). Returns out [batch, q_len, Hq, D], or (out, lse [batch, Hq,
        q_len] float32)."""
        if self.cache_seqlens is None:
            raise RuntimeError("PagedDecode.run() needs a plan(): call plan() first")
        if isinstance(q, torch.Tensor) and tuple(q.shape) != self.q_shape:
            raise ValueError(f"q must have the planned shape {self.q_shape}, got {tuple(q.shape)}")
        table = self.block_table if block_table is None else block_table
        scale, _, softcap = validate_decode(q, k_cache, v_cache, self.cache_seqlens, table, softmax_scale,
                                            self.causal, self.window, softcap, self.num_splits, out, q_descale,
                                            k_descale, v_descale)
        sinks = validate_sinks(sinks, q)
        planned = (self.page_size, self.num_kv_heads)
        if tuple(k_cache.shape[1:3]) != planned:
            raise ValueError(f"k_cache must have the planned page size and kv heads {planned} (dimensions 1 and 2), "
                             f"got shape {tuple(k_cache.shape)}")
        if table.shape != self.block_table.shape:
            raise ValueError(f"block_table must have the planned shape {tuple(self.block_table.shape)}, got "
                             f"{tuple(table.shape)}")
        require_kernels(q)
        return self._run(q, k_cache, v_cache, table, scale, softcap, out, return_softmax_lse, sinks,
                         (q_descale, k_descale, v_descale))

    def _run(self, q, k_cache, v_cache, table, scale, softcap, out, return_softmax_lse, sinks=None,
             descales=(None, None, None)):
        """run() on validated arguments; descales: (q_descale, k_descale, v_descale) of FP8 caches."""
        if _block_table_check_wanted(table):
            check_block_table(table, self.cache_seqlens, k_cache.shape[0], self.page_size)
        if q.dtype == torch.float8_e4m3fn and not (self.split_plan is not None and sinks is None
                                                   and q.shape[-1] in TILE_HEAD_DIMS):
            q = q.to(torch.bfloat16 if out is None else out.dtype)  # exact; only the split kernel takes e4m3
        if self.split_plan is None:
            out, lse = _decode_on_prefill_kernel(q, k_cache, v_cache, self.cache_seqlens, table, scale, self.causal,
                                                 self.window, softcap, out, sinks, descales, self.total_k_bound)
        else:
            out, lse = self._run_split(q, k_cache, v_cache, table, scale, softcap, out, sinks, descales)
        return (out, lse) if return_softmax_lse else out

    def _run_split(self, q, k_cache, v_cache, table, scale, softcap, out, sinks, descales):
        plan, ws = self.split_plan, self.workspace
        q = _addressable_copy(q)
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype,
                              device=q.device)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
        torch.ops.tk.attn_decode(
            q, k_cache, v_cache, self.cache_seqlens, table, ws.work_items, ws.cta_start, ws.partial_out,
            ws.partial_lse, plan.chunk_tokens, plan.item_overhead_tokens, plan.coarsen_levels, self.balanced,
            self.kv_tile, self._claim_schedule(), scale, self.causal, self.window[0], self.window[1], softcap, sinks,
            out, lse, *descales,
        )
        return out, lse

    def _claim_schedule(self) -> bool:
        """Whether this run may reuse the schedule in the workspace (the class docstring's rule); records this run
        as the workspace's last."""
        mark = (self._schedule_id, torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        reuse = self._pooled.schedule == mark
        self._pooled.schedule = mark
        return reuse


def _check_split_plan(plan, batch, max_context, q_len, num_q_heads, num_kv_heads, head_dim, page_size, window_left
                      ) -> None:
    shape = (batch, max_context, q_len, num_q_heads, num_kv_heads, head_dim, page_size, window_left)
    planned = (plan.batch, plan.max_context, plan.q_len, plan.num_q_heads, plan.num_kv_heads, plan.head_dim,
               plan.page_size, plan.window_left)
    if planned != shape:
        raise ValueError(f"split_plan is for (batch, max_context, q_len, q heads, kv heads, head dim, page size, "
                         f"window_left) {planned}, not this step's {shape}")
    if q_len * plan.group > 64:
        raise ValueError(f"split_plan needs q_len x (q heads per kv head) <= 64 rows, got {q_len * plan.group}")


def _decode_on_prefill_kernel(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, window, softcap, out,
                              sinks=None, descales=(None, None, None), total_k_bound=0):
    """Decode on the paged prefill kernel, where each sequence's q_len queries are the last q_len positions of its
    keys: for more rows per kv head than the split kernel's 64-row tile (or TK_DECODE_KERNEL=prefill)."""
    bsz, q_len, hq, d = q.shape
    max_context = block_table.shape[1] * k_cache.shape[1]
    cu_q = torch.arange(0, (bsz + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    flat_out = out.view(bsz * q_len, hq, d) if out is not None and out.is_contiguous() else None
    o, lse = _varlen(q.reshape(bsz * q_len, hq, d), k_cache, v_cache, cu_q, None, cache_seqlens, block_table,
                     q_len, max_context, scale, causal, window, softcap, flat_out, sinks, descales, total_k_bound)
    if out is not None and flat_out is None:
        out.copy_(o.view(bsz, q_len, hq, d))
    out = out if out is not None else o.view(bsz, q_len, hq, d)
    return out, lse.view(hq, bsz, q_len).transpose(0, 1)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int = 0,
    out: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Paged decode: q [B, q_len, Hq, D] (q_len 1..16) against caches [num_blocks, block_size, Hkv, D].

    The q_len new tokens are the last q_len of each sequence's cache_seqlens[b] cached tokens (they must
    already be written to the cache). When the q_len x (Hq / Hkv) query rows of a kv head fit one 64-row
    tile, this runs the split-KV decode kernel on decode_plan's per-shape plan (num_splits > 0 forces the
    split count); larger groups run on the paged prefill kernel. Returns out [B, q_len, Hq, D], or
    (out, lse [B, Hq, q_len] float32) with return_softmax_lse. sinks as in flash_attn_varlen_func.
    FP8 caches (float8_e4m3fn or uint8, head dims multiples of 16) take q_descale / k_descale / v_descale float32
    [B, Hkv] or None (the module docstring's FP8 caches); the split kernel dequantizes their tiles on chip.

    One call plans and runs; the layers of a step share one plan through PagedDecode (its schedule is worked out
    once a step, not once a layer).
    """
    scale, window, softcap = validate_decode(
        q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap, num_splits, out,
        q_descale, k_descale, v_descale,
    )
    sinks = validate_sinks(sinks, q)
    require_kernels(q)
    _, q_len, hq, d = q.shape
    decode = PagedDecode()._plan(cache_seqlens, block_table, hq, k_cache.shape[2], d, k_cache.shape[1], q_len,
                                 causal, window, num_splits, kv_cache_dtype=k_cache.dtype)
    return decode._run(q, k_cache, v_cache, block_table, scale, softcap, out, return_softmax_lse, sinks,
                       (q_descale, k_descale, v_descale))
