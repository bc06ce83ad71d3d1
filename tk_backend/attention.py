"""Attention with flash-attn's API: varlen (optionally paged) prefill, dense batches, and paged decode.

bf16/fp16 q/k/v, float32 softmax, output in q's dtype, lse in float32 (natural log, -inf for a row that
sees no key). Causal masks and windows are aligned bottom-right, as in flash-attn >= 2.1.

Everything here is graph-capturable: validation reads only shapes, dtypes and strides; sequence lengths stay
on the device (max_seqlen_* are host ints supplied by the caller, as in flash-attn). Whether block-table
entries lie in [0, num_blocks) cannot be checked without a host sync, so it is the kernel's input contract;
set TK_CHECK_BLOCK_TABLE=1 to have `check_block_table` verify it (with a sync) before each launch outside
graph capture, for debugging.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from tk_backend import _checks, decode_balanced, decode_plan
from tk_backend._library import lib, require_kernels

HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128, 256)
MAX_DECODE_Q_LEN = 16

_VARLEN_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_k, "
    "Tensor? block_table, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
    "int window_left, int window_right, float softcap"
)
lib.define(f"attn_varlen({_VARLEN_ARGS}) -> (Tensor out, Tensor lse)")
lib.define(f"attn_varlen_out({_VARLEN_ARGS}, Tensor(a!) out, Tensor(b!) lse) -> ()")
# Split-KV decode on a DecodeWorkspace: the op fills work_items / cta_start on the device from cache_seqlens
# and the plan's chunk_tokens / item_overhead / coarsen_levels exactly as decode_plan.build_work_list does (each
# CTA of the split kernel works out and writes its own range, or in balanced mode a schedule kernel runs first;
# with reuse_schedule they already hold it, from an earlier call of the same schedule),
# then runs the kernel and merges partial_out / partial_lse (see decode_plan's docstring for their layout).
# The kernels are csrc/kernels/decode.cu; flash_attn_with_kvcache reaches them through _decode_split.
lib.define(
    "attn_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor block_table, "
    "Tensor(a!) work_items, Tensor(b!) cta_start, Tensor(c!) partial_out, Tensor(d!) partial_lse, "
    "int chunk_tokens, int item_overhead, int coarsen_levels, bool balanced, int kv_tile, bool reuse_schedule, "
    "float softmax_scale, "
    "bool causal, int window_left, int window_right, float softcap, Tensor(e!) out, Tensor(f!) lse) -> ()"
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
        raise ValueError(f"head dim must be 64, 128 or 256, got {d}")
    for t, name in ((k, "k"), (v, "v")):
        if t.shape[-1] != d:
            raise ValueError(f"{name} head dim must equal q's ({d}), got {t.shape[-1]}")


def _kv_like_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str, v_name: str) -> None:
    for t, name in ((k, k_name), (v, v_name)):
        _checks.same_dtype(t, q, name, "q")
        _checks.same_device(t, q, name, "q")
    _head_dims(q, k, v)
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
    out = _checks.tensor(out, "out")
    _checks.same_dtype(out, q, "out", "q")
    _checks.same_device(out, q, "out", "q")
    _checks.shape(out, "out", expected)
    _addressable(out, "out")
    return out


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
    block_table, seqused_k, out,
) -> tuple[float, tuple[int, int], float]:
    """Check every argument of flash_attn_varlen_func; returns (softmax_scale, window, softcap) resolved."""
    q = _half_tensor(q, "q", "[total_q, heads, head_dim]")
    paged = block_table is not None
    kv_layout = "[num_blocks, block_size, kv_heads, head_dim]" if paged else "[total_k, kv_heads, head_dim]"
    k = _half_tensor(k, "k", kv_layout)
    v = _half_tensor(v, "v", kv_layout)
    _kv_like_q(q, k, v, "k", "v")

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


def validate_decode(
    q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap, num_splits, out,
) -> tuple[float, tuple[int, int], float]:
    """Check every argument of flash_attn_with_kvcache; returns (softmax_scale, window, softcap) resolved."""
    q = _half_tensor(q, "q", "[batch, q_len, heads, head_dim]")
    layout = "[num_blocks, block_size, kv_heads, head_dim]"
    k_cache = _half_tensor(k_cache, "k_cache", layout)
    v_cache = _half_tensor(v_cache, "v_cache", layout)
    _kv_like_q(q, k_cache, v_cache, "k_cache", "v_cache")
    batch, q_len = q.shape[0], q.shape[1]
    if batch < 1:
        raise ValueError(f"q must have batch >= 1, got {batch}")
    if not 1 <= q_len <= MAX_DECODE_Q_LEN:
        raise ValueError(f"q_len (q.shape[1]) must be between 1 and {MAX_DECODE_Q_LEN}, got {q_len}")
    _index_tensor(cache_seqlens, "cache_seqlens", (batch,), "[batch]", q)
    if block_table is None:
        raise ValueError(
            "block_table is required: decode reads paged caches [num_blocks, block_size, kv_heads, head_dim]"
        )
    block_table = _checks.tensor(block_table, "block_table", dtypes=(torch.int32,))
    _rank(block_table, "block_table", "[batch, max_blocks]")
    _checks.same_device(block_table, q, "block_table", "q")
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape ({batch}, max_blocks >= 1), got {tuple(block_table.shape)}")
    _paged_cache(k_cache, v_cache, "k_cache", "v_cache")
    _int(num_splits, "num_splits", 0)
    if out is not None:
        _out(out, q, tuple(q.shape))
    _bool(causal, "causal")
    return _scale(softmax_scale, q.shape[-1]), _window(window_size), _softcap(softcap)


# ------------------------------------------------------------------------------------------- public API


def _addressable_copy(t: torch.Tensor) -> torch.Tensor:
    """t itself if the copy engine can read it, else a contiguous copy (cheap next to attention on it)."""
    return t if _checks.tma_ready(t) else t.contiguous()


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
            scale, causal, window, softcap, out) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on validated inputs."""
    q = _addressable_copy(q)
    if block_table is None:
        k, v = _addressable_copy(k), _addressable_copy(v)
    elif _block_table_check_wanted(block_table):
        seqlens = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        check_block_table(block_table, seqlens, k.shape[0], k.shape[1])
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
            scale, causal, window[0], window[1], softcap)
    if out is None:
        return torch.ops.tk.attn_varlen(*args)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    torch.ops.tk.attn_varlen_out(*args, out, lse)
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
):
    """Attention over packed variable-length sequences: q [total_q, Hq, D] -> out [total_q, Hq, D].

    k/v are [total_k, Hkv, D], or paged caches [num_blocks, block_size, Hkv, D] (any strides with a unit last
    one, e.g. halves of a combined K|V cache) addressed through block_table [batch, max_blocks]. Sequence b's
    keys number seqused_k[b] if given, else cu_seqlens_k[b+1] - cu_seqlens_k[b] (cu_seqlens_k may be None
    with seqused_k, as vLLM calls it). max_seqlen_q/k must bound the true lengths (they size the grid).
    Returns out, or (out, lse [Hq, total_q] float32) with return_softmax_lse.
    """
    scale, window, softcap = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
        softcap, block_table, seqused_k, out,
    )
    require_kernels(q)
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                       scale, causal, window, softcap, out)
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
):
    """Attention over a batch of equal-length sequences: q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D] -> [B, Nq, Hq, D].

    Returns out, or (out, lse [B, Hq, Nq] float32) with return_softmax_lse.
    """
    scale, window, softcap = validate_dense(q, k, v, softmax_scale, causal, window_size, softcap, out)
    require_kernels(q)
    bsz, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    cu_q = torch.arange(0, (bsz + 1) * nq, nq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (bsz + 1) * nk, nk, dtype=torch.int32, device=q.device)
    flat_out = out.view(bsz * nq, hq, d) if out is not None and out.is_contiguous() else None
    o, lse = _varlen(q.reshape(bsz * nq, hq, d), k.reshape(bsz * nk, hkv, d), v.reshape(bsz * nk, hkv, d),
                     cu_q, cu_k, None, None, nq, nk, scale, causal, window, softcap, flat_out)
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


# Decode workspaces: one buffer set per (device, row layout, CTA count), shared by every plan of that layout
# (a plan takes a prefix of it). Plans differ per batch size, and vLLM's mixed batches bring any number of
# decode requests, so one buffer per plan would grow without bound. A buffer is allocated on first use
# (before graph capture) and grows by doubling; outgrown buffers stay alive, since a captured CUDA graph may
# still point at them. Every use is on the op's stream, one launch sequence after another.
_workspaces: dict[tuple, list[decode_plan.DecodeWorkspace]] = {}


def _workspace(plan: decode_plan.DecodePlan, device: torch.device, items: int | None = None
               ) -> decode_plan.DecodeWorkspace:
    """A workspace of `items` rows (default: the plan's max_items)."""
    items = plan.max_items if items is None else items
    held = _workspaces.setdefault((device, plan.q_len, plan.group, plan.head_dim, plan.num_ctas), [])
    if not held or held[-1].capacity < items:
        capacity = max(items, 2 * held[-1].capacity if held else 0)
        held.append(decode_plan.DecodeWorkspace.allocate(plan, device, items=capacity, needed=items))
    return held[-1].prefix(items)


# Balanced mode pays where the static work list is mostly empty slots: a block table far wider than the contexts
# (vLLM's is max_model_len wide, and a CUDA graph keeps all of it) or one long sequence, which is where the plan
# cuts each sequence into many splits. 1k contexts under a 128k-token table (32-64 splits at b1 / b8, 16 at b64)
# took 0.64 / 0.75 / 0.83 of the static schedule's time (session 13); at 2-8 splits the static plan of uniform
# contexts is balanced already, and balanced mode's extra pieces cost 1.03x (b8, 8k and 32k contexts).
BALANCED_MIN_SPLITS = 16


def balanced_mode(plan: decode_plan.DecodePlan, num_splits: int = 0) -> bool:
    """Whether _decode_split runs the planner's `plan` in balanced mode (see there)."""
    return (plan.max_items > plan.num_ctas and plan.max_splits >= BALANCED_MIN_SPLITS and num_splits <= 0
            and plan.num_ctas <= decode_balanced.MAX_CTAS)


# What each workspace buffer's work list holds: the schedule key (see _reuses_schedule) of the call that built it,
# by the buffer's address. flash_attn_with_kvcache's schedule_token lets a call skip building the schedule.
_schedules: dict[int, tuple] = {}


def _reuses_schedule(workspace: decode_plan.DecodeWorkspace, key: tuple, token: object) -> bool:
    """Whether the workspace's work list is already this call's: built by a call with the same token and schedule
    key (plan, mode, window, sequence-length tensor), the last on that buffer, and in the same mode of execution
    (a call captured into a CUDA graph is not run then, so an eager call may not reuse it, nor a captured call an
    eager one's). Records this call's."""
    entry = (token, key, torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    held = _schedules.get(workspace.work_items.data_ptr())
    _schedules[workspace.work_items.data_ptr()] = entry
    return token is not None and held == entry


def _decode_split(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, window, softcap, num_splits, out,
                  plan: decode_plan.DecodePlan | None = None, schedule_token: object = None):
    """The split-KV decode kernel on validated inputs (q_len x heads per kv head <= 64 rows); `plan` overrides
    the planner and its static schedule runs as given (scripts/tune.py times chunks with it)."""
    bsz, q_len, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    planned = plan is None
    if planned:
        num_sms, device_name = _device_info(q.device)
        max_context = block_table.shape[1] * block_size
        plan = decode_plan.make_plan(bsz, max_context, q_len, hq, hkv, d, block_size, num_sms, window[0],
                                     num_splits, device_name)
    # Balanced mode (decode_balanced) wherever the planner's plan would schedule (more slots than CTAs) with at
    # least BALANCED_MIN_SPLITS splits a sequence, and num_splits does not force the split: its workspace is two
    # partial slots a CTA (and the stream offsets in work_items), whatever the block table's width. A plan of few
    # splits (many sequences, or a table as wide as the contexts) already gives CTAs whole items, and a one-split
    # plan needs no merge, which balanced mode's cuts would bring back.
    balanced = planned and balanced_mode(plan, num_splits)
    items = decode_balanced.workspace_items(bsz, plan.num_ctas) if balanced else plan.max_items
    workspace = _workspace(plan, q.device, items)
    q = _addressable_copy(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(bsz, hq, q_len, dtype=torch.float32, device=q.device)
    kv_tile = decode_plan.kv_tile(plan, balanced)
    # What the schedule depends on: the plan (batch, q_len, heads, block-table width), the mode (which fixes the kv
    # tile), the window and the lengths (the caller's promise for one token; their tensor here, so another slice of
    # them rebuilds).
    key = (plan, balanced, causal, window, cache_seqlens.data_ptr(), tuple(cache_seqlens.shape))
    torch.ops.tk.attn_decode(
        q, k_cache, v_cache, cache_seqlens, block_table, workspace.work_items, workspace.cta_start,
        workspace.partial_out, workspace.partial_lse, plan.chunk_tokens, plan.item_overhead_tokens,
        plan.coarsen_levels, balanced, kv_tile, _reuses_schedule(workspace, key, schedule_token), scale, causal,
        window[0], window[1], softcap, out, lse,
    )
    return out, lse


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
    *,
    schedule_token: object = None,
):
    """Paged decode: q [B, q_len, Hq, D] (q_len 1..16) against caches [num_blocks, block_size, Hkv, D].

    The q_len new tokens are the last q_len of each sequence's cache_seqlens[b] cached tokens (they must
    already be written to the cache). When the q_len x (Hq / Hkv) query rows of a kv head fit one 64-row
    tile, this runs the split-KV decode kernel on decode_plan's per-shape plan (num_splits > 0 forces the
    split count); larger groups run on the paged prefill kernel. Returns out [B, q_len, Hq, D], or
    (out, lse [B, Hq, q_len] float32) with return_softmax_lse.

    schedule_token (hashable, e.g. one object a decode step): calls that pass the same token promise the same
    cache_seqlens values; the first builds the split kernel's work list on the device and the next ones with the
    same plan, window and cache_seqlens tensor reuse it (not working it out again) while no other call has rebuilt it.
    vLLM's backend passes one token a step, so the layers of a step build the work list once.
    """
    scale, window, softcap = validate_decode(
        q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap, num_splits, out,
    )
    require_kernels(q)
    bsz, q_len, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    if _block_table_check_wanted(block_table):
        check_block_table(block_table, cache_seqlens, num_blocks, block_size)
    if q_len * (hq // hkv) <= 64 and os.environ.get("TK_DECODE_KERNEL", "split") != "prefill":
        out, lse = _decode_split(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, window, softcap,
                                 num_splits, out, schedule_token=schedule_token)
        return (out, lse) if return_softmax_lse else out
    # Too many rows per kv head for one tile (or TK_DECODE_KERNEL=prefill, a debugging fallback): the paged
    # prefill kernel, where each sequence's q_len queries are the last q_len positions of its keys.
    max_context = block_table.shape[1] * block_size
    cu_q = torch.arange(0, (bsz + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    flat_out = out.view(bsz * q_len, hq, d) if out is not None and out.is_contiguous() else None
    o, lse = _varlen(q.reshape(bsz * q_len, hq, d), k_cache, v_cache, cu_q, None, cache_seqlens, block_table,
                     q_len, max_context, scale, causal, window, softcap, flat_out)
    if out is not None and flat_out is None:
        out.copy_(o.view(bsz, q_len, hq, d))
    out = out if out is not None else o.view(bsz, q_len, hq, d)
    lse = lse.view(hq, bsz, q_len).transpose(0, 1)
    return (out, lse) if return_softmax_lse else out
