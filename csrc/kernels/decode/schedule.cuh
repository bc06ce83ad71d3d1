// Decode's schedule: which CTA attends which key range of which (sequence, kv head). Static mode (the plan's chunks,
// each CTA working out its own range: self_schedule) and balanced mode (shares of the step's keys: build_balanced).
// tk_backend/decode_plan.py and decode_balanced.py specify both in Python; the CPU tests check those.
#pragma once
#include <climits>
#include <cub/block/block_scan.cuh>
#include "../../kittens/kittens.cuh"
#include "../attention.h"

namespace tk::decode {

using namespace kittens;

// x / y (rounded down) for x >= 0, y > 0, in the schedule kernels. A 64-bit integer division is a long serial
// routine (step_chunk's thread 0 ran one a level in a row); the double quotient is within one of the truth at these
// sizes and is then made exact. (In the decode kernel's task walk it made the producer spill: that keeps `/`.)
__device__ __forceinline__ long long div_floor(long long x, long long y) {
  long long q = (long long)((double)x / (double)y);
  while (q > 0 && q * y > x) q--;
  while ((q + 1) * y <= x) q++;
  return q;
}

// A context length as the kernels see it: clamped to what the block table can address.
__device__ __forceinline__ int clamped_length(int length, int max_context) { return min(max(length, 0), max_context); }
// Sequence b's visible keys [lo, length): its context clamped to the table, less what the window hides.
__device__ __forceinline__ int2 visible_keys(const int* cache_seqlens, int b, int max_context, int q_len,
                                             int window_left) {
  const int length = clamped_length(cache_seqlens[b], max_context);
  return {window_left >= 0 ? max(length - q_len - window_left, 0) : 0, length};
}

// The chunks of `chunk` keys (aligned at its multiples) that the visible keys [v.x, v.y) touch: 0 when there are none.
__device__ __forceinline__ int chunk_count(int2 v, int chunk) { return ceil_div(v.y, chunk) - v.x / chunk; }

// Slot i of the work list: ((b * hkv) + h) * max_splits + s holds the s-th chunk-aligned key range of sequence b
// that intersects its visible keys [lo_b, L_b) (empty past the sequence's chunks).
struct slot_rule {
  const int* cache_seqlens;
  int hkv, max_splits, max_context, q_len, window_left, chunk_tokens;

  __device__ __forceinline__ int clamped(int length) const { return clamped_length(length, max_context); }
  __device__ __forceinline__ int2 visible(int b) const {
    return visible_keys(cache_seqlens, b, max_context, q_len, window_left);
  }
  // Whether item [start, end) of sequence b is the sequence's only one: then it finalizes into out / lse itself
  // and the merge passes its segment by.
  __device__ __forceinline__ bool whole(int b, int start, int end) const {
    const int2 v = visible(b);
    return end > start && start == v.x && end == v.y;
  }

  __device__ __forceinline__ int4 operator()(int i) const {
    const int per_seq = hkv * max_splits, b = i / per_seq, s = i % max_splits;
    const int2 v = visible(b);
    const int lo = v.x, length = v.y;
    const int first = lo / chunk_tokens, chunks = chunk_count(v, chunk_tokens);
    const int aligned = (first + s) * chunk_tokens;
    const bool used = s < chunks;
    return make_int4(b, (i / max_splits) % hkv, used ? max(aligned, lo) : 0,
                     used ? min(aligned + chunk_tokens, length) : 0);
  }
};

__host__ __device__ inline slot_rule slot_rule_of(const tk::attn_decode_problem& p) {
  return {p.cache_seqlens, p.hkv, p.max_splits, p.max_context, p.q_len, p.window_left, p.chunk_tokens};
}

// What the step's schedule needs beyond the slot rule (decode_plan.build_work_list's inputs); see self_schedule.
struct schedule_rule {
  slot_rule slots;
  int batch, item_overhead, coarsen_levels, max_items;

  // One segment (b, h) of a sequence with visible keys v, at `chunk`: its summed cost (keys + an overhead an item).
  __device__ __forceinline__ long long segment_cost(int2 v, int chunk) const {
    const int n = chunk_count(v, chunk);
    return n > 0 ? (v.y - v.x) + (long long)n * item_overhead : 0;
  }
};

__host__ __device__ inline schedule_rule schedule_rule_of(const tk::attn_decode_problem& p) {
  return {slot_rule_of(p), p.batch, p.item_overhead, p.coarsen_levels, p.max_items};
}

// Balanced mode (tk_backend/decode_balanced.py): segment (b, h) costs overhead + its visible keys, the segments
// (b-major) are laid end to end into a stream of T units, and CTA c owns units [c T / C, (c + 1) T / C). A share
// boundary inside a segment's keys becomes the key cut down to a multiple of `align` (at least the segment's
// first key), so a piece that continues a segment starts on a whole KV tile. seq_at[b] (written by
// build_balanced) is the stream offset of sequence b's first segment; seq_at[batch] = T.
struct balanced_rule {
  const int* cache_seqlens;
  const long long* seq_at;
  int batch, hkv, max_context, q_len, window_left, overhead, align, ctas;

  __device__ __forceinline__ int2 visible(int b) const {
    return visible_keys(cache_seqlens, b, max_context, q_len, window_left);
  }
  __device__ __forceinline__ long long cost(int2 v) const { return v.y > v.x ? overhead + (v.y - v.x) : 0; }
  __device__ __forceinline__ long long begin(int c, long long total) const { return (long long)c * total / ctas; }
  // The CTA whose share holds unit u (the last c with begin(c) <= u).
  __device__ __forceinline__ int cta_of(long long u, long long total) const {
    return int(((u + 1) * ctas + total - 1) / total) - 1;
  }
  // The key at which unit u (of the segment whose units start at `at`) starts a share.
  __device__ __forceinline__ int cut(long long u, long long at, int2 v) const {
    const long long key = v.x + max(u - at - overhead, 0LL);
    return int(min(max(key / align * align, (long long)v.x), (long long)v.y));
  }
  // CTA c's piece of segment (b, h): keys [x, y) (none when y <= x) and its partial slot z: -1 when the piece is
  // the whole segment (it writes out / lse), 2c when it continues a segment begun before this CTA, else 2c + 1.
  __device__ __forceinline__ int4 piece(int c, int b, int h, long long total) const {
    const int2 v = visible(b);
    const long long units = cost(v), at = seq_at[b] + h * units;
    const long long lo = begin(c, total), hi = begin(c + 1, total);
    if (units == 0 || at >= hi || at + units <= lo) return {0, 0, -1, 0};
    const int start = at < lo ? cut(lo, at, v) : v.x, stop = at + units > hi ? cut(hi, at, v) : v.y;
    const bool continues = start > v.x, goes_on = stop < v.y;
    return {start, stop, !continues && !goes_on ? -1 : continues ? 2 * c : 2 * c + 1, 0};
  }
};

template <int ALIGN>
__host__ __device__ inline balanced_rule balanced_rule_of(const tk::attn_decode_problem& p) {
  return {p.cache_seqlens, reinterpret_cast<const long long*>(p.work_items), p.batch, p.hkv, p.max_context, p.q_len,
          p.window_left, p.item_overhead, ALIGN, p.num_ctas};
}

// The schedule of decode_plan.build_work_list: slot ((b * hkv) + h) * max_splits + s holds the s-th chunk-aligned
// key range of sequence b that intersects its visible keys [lo_b, L_b), and CTA c runs the slots whose cost prefix
// `before` has c * total <= ctas * before < (c + 1) * total (cost = keys + a fixed overhead per non-empty item). The
// chunk is the step's: chunk_tokens doubled up to coarsen_levels times (decode_plan.step_chunk). Each CTA of the
// decode kernel works out its own range with its whole block (self_schedule), so no schedule kernel runs before it.
// decode_plan.step_chunk: the candidate chunk C_j = chunk_tokens << j that needs the fewest rounds of full-size
// items, weighted by their size (the largest j on ties), and the step's total cost at it. Each thread sums its
// sequences' costs at every level, each warp reduces them by shuffles, and one thread adds the warps' sums: two
// block syncs, not two a level. Every thread of the block calls it.
struct step_choice {
  int chunk;
  long long total;
};
template <int THREADS>
__device__ step_choice choose_step_chunk(const schedule_rule& r, int ctas) {
  constexpr int LEVELS = tk::DECODE_MAX_COARSEN_LEVELS + 1, WARPS = THREADS / 32;
  __shared__ long long warp_cost[WARPS][LEVELS];
  __shared__ step_choice chosen;
  long long cost[LEVELS] = {};
  const int c0 = r.slots.chunk_tokens;
  for (int b = threadIdx.x; b < r.batch; b += THREADS) {
    const int2 v = r.slots.visible(b);
    // At C_j = chunk_tokens << j: ceil(L / C_j) = ceil(ceil(L / C_0) / 2^j), floor(lo / C_j) = floor(lo / C_0) >> j.
    const int last = ceil_div(v.y, c0), first = v.x / c0;
#pragma unroll
    for (int j = 0; j < LEVELS; j++) {
      const int count = ((last + (1 << j) - 1) >> j) - (first >> j);
      if (j <= r.coarsen_levels && count > 0) cost[j] += (v.y - v.x) + (long long)count * r.item_overhead;
    }
  }
#pragma unroll  // cost[] stays in registers
  for (int j = 0; j < LEVELS; j++) {
    if (j > r.coarsen_levels) break;
    long long c = cost[j];
    for (int o = 16; o; o /= 2) c += __shfl_xor_sync(~0u, c, o);
    if (threadIdx.x % 32 == 0) warp_cost[threadIdx.x / 32][j] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long best = LLONG_MAX;
    step_choice pick{c0, 0};
    for (int j = 0; j <= r.coarsen_levels; j++) {
      long long total = 0;
      for (int w = 0; w < WARPS; w++) total += warp_cost[w][j];
      total *= r.slots.hkv;
      const long long per_item = (long long)(c0 << j) + r.item_overhead;
      const long long span = (long long)ctas * per_item;
      const long long time = div_floor(total + span - 1, span) * per_item;
      if (time <= best) best = time, pick = {c0 << j, total};
    }
    chosen = pick;
  }
  __syncthreads();
  return chosen;
}

// The running sum of value(i) over i in [0, n), a THREADS-wide tile at a time; each thread calls use(i, before,
// value) for its i < n, before = value(0) + ... + value(i - 1). Returns the total (every thread). Every thread
// of the block calls it; the block syncs between tiles.
template <int THREADS, typename Value, typename Use>
__device__ long long scan_in_tiles(int n, Value value, Use use) {
  using scan_t = cub::BlockScan<long long, THREADS>;
  __shared__ typename scan_t::TempStorage storage;
  __shared__ long long carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += THREADS) {
    const int i = base + threadIdx.x;
    const long long v = i < n ? value(i) : 0;
    long long before, tile_total;
    scan_t(storage).ExclusiveSum(v, before, tile_total);
    if (i < n) use(i, carry + before, v);
    __syncthreads();  // everyone has read carry and is done with the scan storage
    if (threadIdx.x == 0) carry += tile_total;
    __syncthreads();
  }
  return carry;
}

// CTA c's slots [cta_start[c], cta_start[c + 1]) of the step's schedule, worked out by the whole block from
// cache_seqlens (every thread calls it). cta_start[c] (c >= 1) is one past the first slot i whose cost prefix end
// E_i = before_i + cost_i has E_i * ctas >= c * total, i.e. E_i >= T_c = ceil(c * total / ctas); cta_start[0] = 0
// and cta_start[ctas] (T = total) is one past the last slot with work (decode_plan.cta_range / slot_after). A scan
// over the sequences finds the one whose units hold each T; then one thread a target finds its kv head by a
// division and its item by one more (a segment's items but its last are whole chunks). That arithmetic stays out
// of the scan's per-thread callback, where it made ptxas build the consumers' wgmma descriptors in ordinary
// registers (docs/findings/decode.md#decode-self-schedule).
// The CTA writes cta_start[c] (the last one cta_start[ctas] too), the work items of its range, which its producer
// reads next, and the slots past the last with work in its 1/ctas stripe of the list: the workspace ends up as
// build_work_list's, for the merge and for later calls that reuse the schedule.
template <int THREADS>
__device__ int2 self_schedule(const schedule_rule& r, int* work_items, int* cta_start, int c, int ctas) {
  __shared__ int seq_of[3], found[3];  // targets k = 0, 1, 2: cta_start[c], cta_start[c + 1], the end of the work
  __shared__ long long before_of[3];
  const step_choice step = choose_step_chunk<THREADS>(r, ctas);
  slot_rule slots = r.slots;
  slots.chunk_tokens = step.chunk;
  const long long total = step.total;
  auto target = [&](int k) { return k == 2 ? total : div_floor((long long)(c + k) * total + ctas - 1, ctas); };
  if (threadIdx.x < 3) seq_of[threadIdx.x] = -1;
  __syncthreads();
  if (total > 0) {
    const long long t0 = target(0), t1 = target(1);
    scan_in_tiles<THREADS>(
        r.batch, [&](int b) { return r.slots.hkv * r.segment_cost(r.slots.visible(b), step.chunk); },
        [&](int b, long long before, long long cost) {  // sequence b holds the units (before, before + cost]
          if (before < t0 && t0 <= before + cost) seq_of[0] = b, before_of[0] = before;
          if (before < t1 && t1 <= before + cost) seq_of[1] = b, before_of[1] = before;
          if (before < total && total <= before + cost) seq_of[2] = b, before_of[2] = before;
        });
  }
  __syncthreads();
  if (threadIdx.x < 3) {
    const int k = threadIdx.x, b = seq_of[k];
    int slot = 0;  // c = 0 starts at slot 0; total = 0: every range is empty
    if (b >= 0 && !(k == 0 && c == 0)) {
      const int2 v = r.slots.visible(b);
      const int per_head = int(r.segment_cost(v, step.chunk));
      const int off = int(target(k) - before_of[k]);  // 1 .. hkv * per_head
      const int h = (off - 1) / per_head, need = off - h * per_head + v.x % step.chunk;
      const int s = min((need - 1) / (step.chunk + r.item_overhead), chunk_count(v, step.chunk) - 1);
      slot = (b * r.slots.hkv + h) * r.slots.max_splits + s + 1;
    }
    found[k] = slot;
  }
  __syncthreads();
  const int start = found[0], end = found[1], end_of_work = found[2];
  if (threadIdx.x == 0) {
    cta_start[c] = start;
    if (c == ctas - 1) cta_start[ctas] = end_of_work;
  }
  auto write = [&](int from, int to) {
    for (int i = from + threadIdx.x; i < to; i += THREADS) reinterpret_cast<int4*>(work_items)[i] = slots(i);
  };
  write(start, end);
  const int stripe = ceil_div(r.max_items, ctas);
  write(max(end_of_work, c * stripe), min((c + 1) * stripe, r.max_items));
  __syncthreads();  // the producer reads its range's items next
  return {start, end};
}

// Balanced mode's schedule (one block): seq_at = the exclusive scan of hkv * cost_b over the batch (into the
// work_items buffer), seq_at[batch] = T, and cta_start[c] = the segment holding unit begin(c) (batch * hkv
// for every c when T = 0), cta_start[ctas] = the end of the last non-empty sequence's segments (so the last CTA
// does not walk the zero-length requests a CUDA graph pads the batch with). Sequence b's segments hold the units
// [seq_at[b], seq_at[b + 1]); the CTAs whose share begins there are ceil(x C / T) .. ceil(y C / T) - 1.
constexpr int SCHEDULE_THREADS = 512;
constexpr int BALANCED_CTAS_PER_THREAD = tk::DECODE_BALANCED_MAX_CTAS / SCHEDULE_THREADS;
static_assert(BALANCED_CTAS_PER_THREAD * SCHEDULE_THREADS == tk::DECODE_BALANCED_MAX_CTAS);

template <int ALIGN>
static __global__ void __launch_bounds__(SCHEDULE_THREADS) build_balanced(tk::attn_decode_problem p) {
  using owner_scan_t = cub::BlockScan<int, SCHEDULE_THREADS>;
  __shared__ typename owner_scan_t::TempStorage owner_storage;
  __shared__ int owner[BALANCED_CTAS_PER_THREAD * SCHEDULE_THREADS];  // per CTA: the sequence starting there, or -1
  chain::allow_next();  // the decode CTAs may set up beside this block; they wait for its writes
  const balanced_rule r = balanced_rule_of<ALIGN>(p);
  long long* seq_at = reinterpret_cast<long long*>(p.work_items);
  const int segs = p.batch * p.hkv, ctas = p.num_ctas;
  for (int c = threadIdx.x; c < BALANCED_CTAS_PER_THREAD * SCHEDULE_THREADS; c += SCHEDULE_THREADS) owner[c] = -1;
  const long long total = scan_in_tiles<SCHEDULE_THREADS>(
      p.batch, [&](int b) { return p.hkv * r.cost(r.visible(b)); },
      [&](int b, long long before, long long) { seq_at[b] = before; });
  if (threadIdx.x == 0) seq_at[p.batch] = total;
  if (total == 0) {
    for (int c = threadIdx.x; c <= ctas; c += SCHEDULE_THREADS) p.cta_start[c] = segs;
    return;
  }
  // The sequence each CTA's share begins in: sequence b (non-empty) marks owner[first CTA whose share begins in
  // it]; a max-scan over the CTAs carries each mark to the CTAs after it. (One thread walking a long sequence's
  // CTAs, a 64-bit division each, took 28 us at batch 1.)
  for (int b = threadIdx.x; b < p.batch; b += SCHEDULE_THREADS) {  // the thread that wrote seq_at[b]
    const long long units = r.cost(r.visible(b)), x = seq_at[b], y = x + p.hkv * units;
    if (units == 0) continue;
    if (y == total) p.cta_start[ctas] = (b + 1) * p.hkv;  // the last non-empty sequence
    const long long c0 = div_floor(x * ctas + total - 1, total);
    const long long c1 = min(div_floor(y * ctas + total - 1, total), (long long)ctas);
    if (c0 < c1) owner[c0] = b;
  }
  __syncthreads();
  int mark[BALANCED_CTAS_PER_THREAD];
#pragma unroll
  for (int k = 0; k < BALANCED_CTAS_PER_THREAD; k++) mark[k] = owner[threadIdx.x * BALANCED_CTAS_PER_THREAD + k];
  owner_scan_t(owner_storage).InclusiveScan(mark, mark, [](int a, int b) { return max(a, b); });
#pragma unroll
  for (int k = 0; k < BALANCED_CTAS_PER_THREAD; k++) {
    const int c = threadIdx.x * BALANCED_CTAS_PER_THREAD + k, b = mark[k];
    if (c >= ctas) break;
    const long long units = r.cost(r.visible(b));  // b >= 0: the first non-empty sequence owns CTA 0
    p.cta_start[c] = b * p.hkv + int(min(div_floor(r.begin(c, total) - seq_at[b], units), (long long)p.hkv - 1));
  }
}

}  // namespace tk::decode
