"""Split-KV plan for paged decode: which CTA attends which pages, and how partial results are merged.

Two halves, so that decode can be captured in a CUDA graph for a fixed batch size:

* `DecodePlan` (host, static): chosen once per batch *shape* from tk_backend/configs/<gpu>.json or the analytic
  cost model below; it fixes the KV chunk size (a multiple of the page size), the most chunks a sequence can
  have, the number of persistent CTAs (the SM count), and so every workspace size.
* `build_work_list` (device, per step): reads the per-sequence context lengths, which exist only on the
  device, and fills a preallocated `DecodeWorkspace` with torch ops only: no host sync, no data-dependent
  shapes, the same kernels on every replay. The decode kernel (csrc/kernels/decode.cu) computes exactly this,
  each CTA its own range (`cta_range`) and its items, with no kernel launched before it; this version is its
  specification and the CPU tests' subject.

Work decomposition
    A segment is (sequence b, kv head h): all q_len * (Hq // Hkv) query rows that read kv head h, against the
    keys [lo_b, L_b) of sequence b, where L_b = cache_seqlens[b] and lo_b = max(0, L_b - q_len - window_left)
    with a left window (keys before it are invisible to every query), else 0.
    Chunks are aligned in absolute key positions: chunk c covers [c * C, (c + 1) * C) with C = the step's chunk, so
    a chunk never starts mid-page (C is the step's chunk: see Coarsening). The s-th chunk of segment (b, h) that
    intersects [lo_b, L_b) is work item slot ((b * Hkv) + h) * max_splits + s; slots past a segment's chunk count
    are empty (start == end == 0).
    work_items[slot] = (b, h, start, end), the key range of that item.

Coarsening (per step, on the device)
    The plan's chunk suits the batch shape's worst case: one long sequence among short ones, which must still
    spread over the SMs. When the step's sequences are long enough to fill the SMs with larger chunks, fewer
    items pay less fixed cost (docs/findings/decode.md#decode-coarsen). So a step may double the chunk up to
    `coarsen_levels` times: C_j = chunk_tokens << j, and with cost_j the total cost of the step's items at C_j
    (below), it takes the j that minimises rounds_j * (C_j + overhead), rounds_j = ceil(cost_j / (num_ctas *
    (C_j + overhead))) (the rounds of full-size items the SMs need), the largest j on ties. C_j is a multiple of
    C, so a segment has no more chunks at C_j than at C and the plan's slots still hold them. The plan allows
    coarsening only when the schedule runs (more slots than CTAs) and num_splits was not forced.

CTA assignment (persistent grid of num_ctas CTAs)
    An item costs its key count plus a fixed overhead (`item_overhead_tokens`); empty items cost 0. With
    `before[i]` the summed cost of slots < i and `total` the sum of all, CTA c runs the contiguous slots
    i in [cta_start[c], cta_start[c + 1]), namely those with c * total <= num_ctas * before[i] < (c + 1) * total.
    So every CTA gets at most total / num_ctas + one item's cost: the imbalance is bounded by one chunk. The end
    marker cta_start[num_ctas] is one past the last slot with work. A CTA walks its range from slot to slot
    with work (next_slot): after a segment's last chunk it goes straight to the next segment's first slot, so a
    step whose chunk leaves most slots empty (a max_model_len-wide table, short contexts) does not pay for them.

Combine (the LSE merge)
    Item i writes, for each of its rows r = (query t, head-in-group g):
        partial_lse[i, t, g]    = log sum_j exp(s_rj)          over the item's keys j visible to r
        partial_out[i, t, g, :] = sum_j exp(s_rj - lse) v_j     (already normalised within the chunk)
    where s_rj is the scaled (and soft-capped) score; a row with no visible key in the chunk has lse = -inf and
    contributes nothing. For segment (b, h) and row r, over its non-empty slots i:
        m   = max_i partial_lse[i, r];  if m == -inf: out = 0, lse = -inf (no visible key at all)
        w_i = exp(partial_lse[i, r] - m)
        out = sum_i w_i partial_out[i, r] / sum_i w_i,   lse = m + log sum_i w_i
    A segment with a single non-empty item may write out/lse directly and skip the merge; the result is the
    same. `merge_partials` is this merge in torch.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

# The tuned tables ship inside the package (package data), so an installed copy finds its own.
CONFIG_DIR: Traversable = importlib.resources.files("tk_backend") / "configs"

# Below two 128-key tiles per chunk the kernel's load pipeline never reaches steady state.
MIN_CHUNK_TOKENS = 256
# Partial results of split sequences are float32: cap them so a huge batch x context shape cannot take
# gigabytes of workspace just to balance better.
MAX_WORKSPACE_BYTES = 256 << 20

# Analytic cost model, in microseconds of one SM. Decode is memory bound: an SM streams its share of HBM
# bandwidth (~4.8 TB/s over 132 SMs on H200, less achieved), and each item pays a fixed latency to fill its
# load pipeline and write its partial; splitting a segment costs a grid-wide dependency before the merge.
SM_BYTES_PER_US = 30_000
ITEM_LATENCY_US = 1.0
MERGE_LATENCY_US = 3.0
# The chunk choice's own item latency and the cost of a schedule (a step of more items than CTAs: the schedule
# kernel, or the split kernel's self-schedule, and the walk over its slots), fitted so that the model picks what
# scripts/tune.py measured on the H200 (configs/h200.json: the same chunk in 16 of 24 buckets, within 2x in all;
# with ITEM_LATENCY_US and no schedule cost: 4 of 24, 16 within 2x, every miss a finer chunk). ITEM_LATENCY_US stays
# the device schedule's item cost (coarsening, CTA shares), which the fit does not move.
MODEL_ITEM_LATENCY_US = 5.0
SCHEDULE_LATENCY_US = 8.0

# The caches' element kinds a plan (and a config bucket) is for, and the bytes an element takes: bf16 / fp16, or
# float8_e4m3fn (FP8 KV caches: a token streams half the bytes).
KV_DTYPE_BYTES = {"16bit": 2, "fp8_e4m3": 1}


def kv_dtype_of(dtype: torch.dtype | None) -> str:
    """The element kind of caches of `dtype` (None: 16-bit); uint8 caches hold float8_e4m3fn bytes (vLLM's)."""
    return "fp8_e4m3" if dtype in (torch.float8_e4m3fn, torch.uint8) else "16bit"


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    batch: int
    max_context: int  # tokens a sequence can hold: block_table columns x page size
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    window_left: int  # -1: unbounded
    num_ctas: int
    chunk_tokens: int  # multiple of page_size
    max_splits: int  # chunks one segment can have
    source: str  # "table", "analytic" or "num_splits"
    coarsen_levels: int = 0  # how many times a step may double chunk_tokens (module docstring: Coarsening)
    kv_dtype: str = "16bit"  # the caches' element kind (KV_DTYPE_BYTES)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_items(self) -> int:
        return self.batch * self.num_kv_heads * self.max_splits

    @property
    def item_overhead_tokens(self) -> int:
        return item_overhead_tokens(self.q_len * self.group, self.head_dim, self.kv_dtype)


def tile_head_dim(head_dim: int) -> int:
    """The kernel tile a head dim runs on (64, 128 or 256 columns): partial outputs keep the tile's columns."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


@dataclasses.dataclass
class DecodeWorkspace:
    """Device buffers of one plan; allocate once (e.g. before graph capture) and reuse on every step."""

    work_items: torch.Tensor  # int32 [max_items, 4]: (sequence, kv head, key start, key end)
    cta_start: torch.Tensor  # int32 [num_ctas + 1]: CTA c runs slots [cta_start[c], cta_start[c + 1])
    partial_out: torch.Tensor  # float32 [max_items, q_len, group, tile_head_dim(head_dim)]
    partial_lse: torch.Tensor  # float32 [max_items, q_len, group]

    @classmethod
    def allocate(cls, plan: DecodePlan, device: torch.device | str, items: int | None = None,
                 needed: int | None = None) -> "DecodeWorkspace":
        """Buffers for `items` work items (default: exactly plan.max_items) of plan's row layout; `needed` (default
        plan.max_items) is the least the caller's use takes (balanced decode: decode_balanced.workspace_items)."""
        n = plan.max_items if items is None else items
        needed = plan.max_items if needed is None else needed
        if n < needed:
            raise ValueError(f"a workspace of {n} items cannot hold the plan's {needed}")
        return cls(
            work_items=torch.empty(n, 4, dtype=torch.int32, device=device),
            cta_start=torch.empty(plan.num_ctas + 1, dtype=torch.int32, device=device),
            partial_out=torch.empty(n, plan.q_len, plan.group, tile_head_dim(plan.head_dim), dtype=torch.float32,
                                    device=device),
            partial_lse=torch.empty(n, plan.q_len, plan.group, dtype=torch.float32, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.work_items.shape[0]

    def prefix(self, items: int) -> "DecodeWorkspace":
        """The first `items` slots (views): what a plan with max_items = items uses of a larger workspace."""
        if items > self.capacity:
            raise ValueError(f"the workspace holds {self.capacity} items, not {items}")
        return DecodeWorkspace(self.work_items[:items], self.cta_start, self.partial_out[:items],
                               self.partial_lse[:items])


# --------------------------------------------------------------------------------------- static planning


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _token_bytes(head_dim: int, kv_dtype: str) -> int:
    return 2 * head_dim * KV_DTYPE_BYTES[kv_dtype]  # one key and one value


def item_overhead_tokens(rows: int, head_dim: int, kv_dtype: str = "16bit", latency_us: float | None = None) -> int:
    """An item's fixed cost in key-token equivalents: pipeline latency (ITEM_LATENCY_US unless given) plus its Q
    load and partial store/reload."""
    row_bytes = rows * head_dim * (2 + 4 + 4)  # Q in, float32 partial out, read back by the merge
    latency = ITEM_LATENCY_US if latency_us is None else latency_us
    return _ceil_div(int(latency * SM_BYTES_PER_US) + row_bytes, _token_bytes(head_dim, kv_dtype))


def _span_tokens(max_context: int, q_len: int, window_left: int) -> int:
    """The most keys one segment attends: the whole context, or the window plus the new tokens."""
    return max_context if window_left < 0 else min(max_context, window_left + q_len)


def _max_splits(chunk: int, max_context: int, q_len: int, window_left: int) -> int:
    splits = _ceil_div(max_context, chunk)
    if window_left >= 0:  # an unaligned span of w keys touches at most ceil(w / chunk) + 1 chunks
        splits = min(splits, _ceil_div(window_left + q_len, chunk) + 1)
    return max(splits, 1)


# The decode kernel's step-chunk choice keeps one cost per candidate chunk in registers: at most this many doublings.
MAX_COARSEN_LEVELS = 15


def coarsen_levels(chunk: int, span: int) -> int:
    """Doublings of `chunk` until one chunk holds a whole span of `span` keys (a sequence in one item)."""
    levels = 0
    while (chunk << levels) < span and levels < MAX_COARSEN_LEVELS:
        levels += 1
    return levels


def _makespan_us(
    segments: int, span: int, chunk: int, splits: int, overhead: int, num_ctas: int, head_dim: int,
    kv_dtype: str = "16bit",
) -> float:
    """Balanced-partition bound: average CTA load plus one item, plus the merge latency if anything is split and a
    schedule's if the items outnumber the CTAs (direct mode, a CTA an item, needs none)."""
    token_us = _token_bytes(head_dim, kv_dtype) / SM_BYTES_PER_US
    total = segments * (span + splits * overhead) * token_us
    biggest = (min(chunk, span) + overhead) * token_us
    return (total / num_ctas + biggest + (MERGE_LATENCY_US if splits > 1 else 0.0)
            + (SCHEDULE_LATENCY_US if segments * splits > num_ctas else 0.0))


def analytic_chunk_tokens(
    batch: int, max_context: int, q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    page_size: int, num_ctas: int, window_left: int = -1, kv_dtype: str = "16bit",
) -> int:
    """The chunk size minimising the modelled time of two extremes of a fixed-shape batch.

    All sequences at max context (throughput: favours few splits) and one sequence at max context with the
    rest empty (latency: favours many splits, or the SMs idle). A CUDA graph replays both, so the chunk must
    not be terrible at either; ties go to the larger chunk (fewer partials).
    """
    span = _span_tokens(max_context, q_len, window_left)
    rows = q_len * (num_q_heads // num_kv_heads)
    overhead = item_overhead_tokens(rows, head_dim, kv_dtype, MODEL_ITEM_LATENCY_US)
    chunk = _ceil_div(MIN_CHUNK_TOKENS, page_size) * page_size
    best: tuple[float, int] | None = None
    while True:
        splits = _max_splits(chunk, max_context, q_len, window_left)
        workspace = batch * num_kv_heads * splits * rows * (head_dim + 1) * 4
        if workspace <= MAX_WORKSPACE_BYTES or splits == 1:
            cost = sum(
                _makespan_us(seqs * num_kv_heads, span, chunk, splits, overhead, num_ctas, head_dim, kv_dtype)
                for seqs in (batch, 1)
            )
            if best is None or cost <= best[0]:
                best = (cost, chunk)
        if chunk >= span:
            return best[1]
        chunk *= 2


@functools.lru_cache(maxsize=256)
def make_plan(
    batch: int, max_context: int, q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    page_size: int, num_sms: int, window_left: int = -1, num_splits: int = 0, device_name: str | None = None,
    kv_dtype: str = "16bit",
) -> DecodePlan:
    """The plan for one batch shape over caches of element kind kv_dtype (KV_DTYPE_BYTES). num_splits > 0 forces
    that many chunks per full-length sequence (like flash-attn's num_splits); otherwise CONFIG_DIR's table for
    `device_name`, then the analytic model."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    if num_splits > 0:
        chunk, source = _ceil_div(_ceil_div(max(max_context, 1), num_splits), page_size) * page_size, "num_splits"
    else:
        chunk = lookup_chunk_tokens(
            device_config(device_name), batch, max_context, q_len, num_q_heads // num_kv_heads, head_dim, kv_dtype
        )
        source = "table"
        if chunk is None:
            chunk = analytic_chunk_tokens(batch, max_context, q_len, num_q_heads, num_kv_heads, head_dim,
                                          page_size, num_sms, window_left, kv_dtype)
            source = "analytic"
        chunk = _ceil_div(chunk, page_size) * page_size
    plan = DecodePlan(
        batch=batch, max_context=max_context, q_len=q_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, window_left=window_left, num_ctas=num_sms, chunk_tokens=chunk,
        max_splits=_max_splits(chunk, max_context, q_len, window_left), source=source, kv_dtype=kv_dtype,
    )
    return plan if source == "num_splits" else coarsened(plan)  # num_splits means what it says


def coarsened(plan: DecodePlan) -> DecodePlan:
    """The plan with the coarsening its shape allows: none in direct mode (a CTA per slot, no schedule
    kernel), else doublings until a chunk holds a whole span."""
    if plan.max_items <= plan.num_ctas:
        return dataclasses.replace(plan, coarsen_levels=0)
    span = _span_tokens(plan.max_context, plan.q_len, plan.window_left)
    return dataclasses.replace(plan, coarsen_levels=coarsen_levels(plan.chunk_tokens, span))


# ----------------------------------------------------------------------------------- device work list


def build_work_list(plan: DecodePlan, cache_seqlens: torch.Tensor, workspace: DecodeWorkspace) -> None:
    """Fill workspace.work_items and .cta_start from the device-resident context lengths, without a host sync.

    Lengths beyond plan.max_context (the block table's capacity) are clamped to it, so the kernel never reads
    past the table; such a sequence is truncated, which is the caller's contract to avoid.
    """
    dev = cache_seqlens.device
    splits, hkv = plan.max_splits, plan.num_kv_heads
    length, lo = _visible_keys(plan, cache_seqlens)
    chunk = step_chunk(plan, cache_seqlens)
    first_chunk = lo // chunk
    num_chunks = (length + chunk - 1) // chunk - first_chunk  # 0 for an empty sequence

    s = torch.arange(splits, device=dev)
    aligned = (first_chunk[:, None] + s) * chunk  # [B, S]
    start = torch.maximum(aligned, lo[:, None])
    end = torch.minimum(aligned + chunk, length[:, None])
    used = s < num_chunks[:, None]
    start, end = start * used, end * used  # empty slots: start == end == 0

    shape = (plan.batch, hkv, splits)
    seq = torch.arange(plan.batch, device=dev)[:, None, None].expand(shape)
    head = torch.arange(hkv, device=dev)[None, :, None].expand(shape)
    items = torch.stack([seq, head, start[:, None].expand(shape), end[:, None].expand(shape)], dim=-1)
    workspace.work_items.copy_(items.reshape(-1, 4))

    cost = ((end - start) + plan.item_overhead_tokens * used)[:, None].expand(shape).reshape(-1)
    before = torch.cumsum(cost, 0) - cost
    total = cost.sum()
    ctas = plan.num_ctas
    bounds = torch.searchsorted(before * ctas, torch.arange(ctas, device=dev) * total)
    workspace.cta_start[:ctas].copy_(bounds)
    # The end marker: one past the last slot with work (0 when there is none), so the last CTA does not walk
    # the empty sequences a CUDA graph pads the batch with.
    slots = torch.arange(1, cost.numel() + 1, device=dev)
    workspace.cta_start[ctas:].copy_(torch.where(cost > 0, slots, 0).max())


def full_length_step_chunk(plan: DecodePlan) -> int:
    """step_chunk for a batch whose sequences all hold max_context tokens, in plain Python (the plan's shape, as
    the host sees it: no tensors, nothing for a tracer or a graph capture to see)."""
    lo, length = visible(plan.max_context, plan.max_context, plan.q_len, plan.window_left)
    overhead, best, chosen = plan.item_overhead_tokens, None, plan.chunk_tokens
    for j in range(plan.coarsen_levels + 1):
        chunk = plan.chunk_tokens << j
        count = _ceil_div(length, chunk) - lo // chunk
        cost = (length - lo + count * overhead) * plan.batch * plan.num_kv_heads if count > 0 else 0
        per_item = chunk + overhead
        time = _ceil_div(cost, plan.num_ctas * per_item) * per_item
        if best is None or time <= best:  # the largest j on ties
            best, chosen = time, chunk
    return chosen


# Keys a K/V tile in the D=128 decode kernel (csrc/kernels/decode/): 64-key tiles (6 stages) stream short work
# faster, 128-key tiles (3 stages) long work (docs/findings/decode.md#decode-kv-gate).
KV64_STEP_CHUNKS = (1024, 4096)
# Over FP8 caches (the e4m3-query kernel): a 4096-key step chunk streams on 128-key tiles, as balanced mode's long
# pieces do there (balanced_fp8_kv128); docs/findings/decode.md#decode-fp8-kv128-static.
KV64_STEP_CHUNKS_FP8 = (1024, 2048)


def balanced_fp8_kv128(plan: DecodePlan) -> bool:
    """Balanced mode over fp8 caches runs 128-key tiles at batch >= 8 with tables up to 32k tokens, or batch >= 64
    at any width: measured 0.94-0.98x the 64-key tiles' time there, 1.02-1.04x at batch 1 and at batch 8 under a
    128k-token table, whose short steps the full-width plan over-counts (docs/findings/decode.md#decode-fp8-query)."""
    return plan.batch >= 64 or (plan.batch >= 8 and plan.max_context <= 32768)


@functools.lru_cache(maxsize=256)
def kv_tile(plan: DecodePlan, balanced: bool) -> int:
    """The decode kernel's K/V tile for `plan` (64 or 128 keys; see KV64_STEP_CHUNKS). Over FP8 caches the D=128
    kernel for an e4m3 query has both (a 16-bit query's runs 64-key tiles at either: its converted ring of 128-key
    tiles would not fit, csrc/kernels/decode/policy.cuh)."""
    if plan.head_dim != 128:
        return 128
    if balanced:
        return 128 if plan.kv_dtype != "16bit" and balanced_fp8_kv128(plan) else 64
    lo, hi = KV64_STEP_CHUNKS if plan.kv_dtype == "16bit" else KV64_STEP_CHUNKS_FP8
    return 64 if lo <= full_length_step_chunk(plan) <= hi else 128


def _visible_keys(plan: DecodePlan, cache_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(length, lo) per sequence, int64: the clamped context length and the first key any query sees."""
    length = cache_seqlens.to(torch.int64).clamp(0, plan.max_context)  # [B]
    if plan.window_left >= 0:
        return length, (length - plan.q_len - plan.window_left).clamp_min(0)
    return length, torch.zeros_like(length)


def step_chunk(plan: DecodePlan, cache_seqlens: torch.Tensor) -> torch.Tensor:
    """The step's chunk (a 0-dim int64 tensor on the lengths' device, no host sync): chunk_tokens doubled as
    the module docstring's Coarsening says."""
    length, lo = _visible_keys(plan, cache_seqlens)
    chunks = plan.chunk_tokens * 2 ** torch.arange(plan.coarsen_levels + 1, device=length.device)  # [J]
    count = (length[:, None] + chunks - 1) // chunks - lo[:, None] // chunks  # [B, J], 0 for an empty sequence
    overhead = plan.item_overhead_tokens
    cost = torch.where(count > 0, (length - lo)[:, None] + count * overhead, 0).sum(0) * plan.num_kv_heads
    per_item = chunks + overhead
    rounds = (cost + plan.num_ctas * per_item - 1) // (plan.num_ctas * per_item)
    best = plan.coarsen_levels - torch.argmin((rounds * per_item).flip(0))  # the largest j on ties
    return plan.chunk_tokens * 2**best  # arithmetic, not chunks[best]: no data-dependent indexing to trace


def visible(length: int, max_context: int, q_len: int, window_left: int) -> tuple[int, int]:
    """(lo, L) of one sequence with `length` cached keys: _visible_keys for a Python int (the keys [lo, L) some
    query sees: the context clamped to the table, less what the window hides)."""
    length = min(max(length, 0), max_context)
    return (max(length - q_len - window_left, 0) if window_left >= 0 else 0), length


def _visible(plan: DecodePlan, length: int) -> tuple[int, int]:
    return visible(length, plan.max_context, plan.q_len, plan.window_left)


def segment(plan: DecodePlan, length: int, chunk: int | None = None) -> tuple[int, int, int, int]:
    """(lo, first chunk, chunk count, cost) of a sequence with `length` cached keys, in chunks of `chunk`
    (default: the plan's; a coarsened step's is step_chunk): the per-sequence closed form behind
    build_work_list (every kv head of the sequence has the same segment)."""
    chunk = chunk or plan.chunk_tokens
    lo, length = _visible(plan, length)
    first = lo // chunk
    chunks = max(_ceil_div(length, chunk) - first, 0)
    return lo, first, chunks, (length - lo) + chunks * plan.item_overhead_tokens if chunks else 0


def slot_after(plan: DecodePlan, lengths: list[int], target: int, chunk: int | None = None) -> int:
    """One past the first slot i whose cost prefix end E_i = before_i + cost_i reaches `target` (E_i >= target
    >= 1), computed per sequence rather than per slot, as each decode CTA does for its own range (self_schedule in
    csrc/kernels/decode.cu): the sequence b whose units (before_b, before_b + cost_b] hold the target, then its kv
    head by a division, then the item by one more (a segment's items but its last are whole chunks)."""
    chunk = chunk or plan.chunk_tokens
    hkv, splits, overhead = plan.num_kv_heads, plan.max_splits, plan.item_overhead_tokens
    before = 0
    for b, length in enumerate(lengths):
        lo, first, chunks, seg = segment(plan, length, chunk)
        if before < target <= before + hkv * seg:
            off = target - before
            h = (off - 1) // seg
            need = off - h * seg + (lo - first * chunk)
            s = min(_ceil_div(need, chunk + overhead) - 1, chunks - 1)
            return (b * hkv + h) * splits + s + 1
        before += hkv * seg
    raise ValueError(f"target {target} past the step's total cost {before}")


def cta_range(plan: DecodePlan, lengths: list[int], cta: int, chunk: int | None = None) -> tuple[int, int]:
    """The slots [start, end) CTA `cta` runs: workspace.cta_start[cta], workspace.cta_start[cta + 1] (at the
    step's chunk, if coarsened). cta_start[c] is one past the first slot whose E_i * num_ctas >= c * total, i.e.
    slot_after(ceil(c * total / num_ctas)); cta_start[0] = 0, and cta_start[num_ctas] = slot_after(total) is one
    past the last slot with work."""
    total = plan.num_kv_heads * sum(segment(plan, length, chunk)[3] for length in lengths)
    if total == 0:
        return (0, 0)

    def bound(c: int) -> int:
        return 0 if c == 0 else slot_after(plan, lengths, _ceil_div(c * total, plan.num_ctas), chunk)

    return bound(cta), bound(cta + 1)


def next_slot(plan: DecodePlan, lengths: list[int], slot: int, chunk: int | None = None) -> int:
    """The slot a CTA runs after `slot`: the next one while the segment has more chunks, else the next segment's
    first (a segment's used slots come first, so its empty ones are passed in one step)."""
    b = slot // (plan.num_kv_heads * plan.max_splits)
    if slot % plan.max_splits + 1 < segment(plan, lengths[b], chunk)[2]:
        return slot + 1
    return (slot // plan.max_splits + 1) * plan.max_splits


def merge_partials(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine step in torch: partial_out [..., S, R, D], partial_lse [..., S, R], valid [..., S] bool.

    Returns (out [..., R, D], lse [..., R]); rows with no visible key anywhere get out = 0, lse = -inf.
    """
    lse = partial_lse.float().masked_fill(~valid[..., None], -math.inf)
    m = lse.amax(dim=-2, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # finite even if all -inf
    w = torch.exp(lse - m)  # [..., S, R]
    total = w.sum(dim=-2)  # [..., R]
    out = torch.einsum("...sr,...srd->...rd", w, partial_out.float().nan_to_num()) / total.clamp_min(1e-30)[..., None]
    return out, m.squeeze(-2) + torch.log(total)


# ------------------------------------------------------------------------------------------ config table


@dataclasses.dataclass(frozen=True)
class DecodeBucket:
    """One row of a config table: inclusive ranges of a batch shape, and the chunk size tuned for it."""

    batch: tuple[int, int]
    max_context: tuple[int, int]
    q_len: tuple[int, int]
    group: tuple[int, int]  # Hq // Hkv
    head_dim: tuple[int, ...] | None  # None: any
    chunk_tokens: int
    # The caches' element kinds it was tuned on: a bucket without the key, 16-bit caches (as the tables were tuned).
    kv_dtype: tuple[str, ...] = ("16bit",)

    def matches(self, batch: int, max_context: int, q_len: int, group: int, head_dim: int,
                kv_dtype: str = "16bit") -> bool:
        return (
            self.batch[0] <= batch <= self.batch[1]
            and self.max_context[0] <= max_context <= self.max_context[1]
            and self.q_len[0] <= q_len <= self.q_len[1]
            and self.group[0] <= group <= self.group[1]
            and (self.head_dim is None or head_dim in self.head_dim)
            and kv_dtype in self.kv_dtype
        )


def _int_range(entry: dict, key: str, where: str) -> tuple[int, int]:
    value = entry.get(key, [0, 2**62])
    ok = isinstance(value, list) and len(value) == 2 and all(isinstance(x, int) for x in value)
    if not (ok and value[0] <= value[1]):
        raise ValueError(f"{where}: {key} must be [low, high] integers with low <= high, got {value!r}")
    return value[0], value[1]


def load_config(path: str | Path | Traversable) -> tuple[DecodeBucket, ...]:
    """The decode buckets of a config file, in file order (the first matching bucket wins)."""
    path = Path(path) if isinstance(path, str) else path
    data = json.loads(path.read_text())
    buckets = []
    for i, entry in enumerate(data.get("decode", {}).get("buckets", [])):
        where = f"{path} decode.buckets[{i}]"
        chunk = entry.get("chunk_tokens")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"{where}: chunk_tokens must be a positive integer, got {chunk!r}")
        head_dim = entry.get("head_dim")
        if head_dim is not None and not (isinstance(head_dim, list) and all(isinstance(d, int) for d in head_dim)):
            raise ValueError(f"{where}: head_dim must be a list of integers, got {head_dim!r}")
        kv_dtype = entry.get("kv_dtype", ["16bit"])
        if not (isinstance(kv_dtype, list) and kv_dtype and all(k in KV_DTYPE_BYTES for k in kv_dtype)):
            raise ValueError(f"{where}: kv_dtype must be a non-empty list of {', '.join(map(repr, KV_DTYPE_BYTES))}, "
                             f"got {kv_dtype!r}")
        buckets.append(DecodeBucket(
            batch=_int_range(entry, "batch", where),
            max_context=_int_range(entry, "max_context", where),
            q_len=_int_range(entry, "q_len", where),
            group=_int_range(entry, "group", where),
            head_dim=tuple(head_dim) if head_dim is not None else None,
            chunk_tokens=chunk,
            kv_dtype=tuple(kv_dtype),
        ))
    return tuple(buckets)


@functools.lru_cache(maxsize=None)
def device_config(device_name: str | None) -> tuple[DecodeBucket, ...]:
    """The buckets of the CONFIG_DIR/*.json whose "device" equals device_name; none if there is no such file."""
    if device_name is None or not CONFIG_DIR.is_dir():
        return ()
    for path in sorted((p for p in CONFIG_DIR.iterdir() if p.name.endswith(".json")), key=lambda p: p.name):
        if json.loads(path.read_text()).get("device") == device_name:
            return load_config(path)
    return ()


def lookup_chunk_tokens(
    buckets: tuple[DecodeBucket, ...], batch: int, max_context: int, q_len: int, group: int, head_dim: int,
    kv_dtype: str = "16bit",
) -> int | None:
    for bucket in buckets:
        if bucket.matches(batch, max_context, q_len, group, head_dim, kv_dtype):
            return bucket.chunk_tokens
    return None
