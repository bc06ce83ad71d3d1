// Split-KV paged decode on kittens. A work item is (sequence, kv head, key range); the query rows of one KV
// head (q_len new tokens x the heads of its group, at most 64) are packed into one 64-row tile, so every
// query head of the group shares each K/V load and one wgmma. CTA c runs the items the plan gave it, in
// order, while its producer streams the item's keys page piece by page piece (16 rows, any block size).
// Each item leaves a normalised partial output and its LSE; a small kernel then merges a segment's items. An
// item that covers its sequence's whole visible range (the usual case once a step's chunk is coarsened) writes
// out and lse itself, and the merge passes its segment by.
#include <cub/block/block_scan.cuh>
#include "../kittens/kittens.cuh"
#include "attention.h"
#include "attention_common.cuh"

using namespace kittens;

namespace {

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
// of the scan's per-thread callback: there it made ptxas build the consumers' wgmma descriptors in ordinary
// registers (R2UR 38 -> 226 in the kernel) and every decode case ran 2-13% slower, those without this schedule too.
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

// Tile: keys a K/V tile at D=128 (attn_decode_problem::kv_tile, chosen by decode_plan.kv_tile). 64-key tiles in 6
// stages hold the ring bytes of 128 x 3, but a consumer hands a stage back twice as often and more of the ring
// is in flight: short items (1-4k keys a CTA) and balanced pieces stream faster (b8 8k contexts, one 4096-key
// item a CTA: 0.973 of 128-key tiles' time; b64 1k 0.955; 128k tables 0.90-0.94), long ones slower (8k+ keys an
// item, several items a CTA: 1.02-1.05).
// Scheduling: the kernel of a step's static schedule (not direct, not balanced) whose CTAs work out their ranges
// (self_schedule). The other kernel (direct mode, balanced mode, or a schedule an earlier call of the step left)
// carries no scheduling code: compiled into one kernel, its presence alone slowed those cases 3-6% (session 27).
template <typename T, int D, int Tile = 128, bool Scheduling = false>
struct attn_decode_split {
  static constexpr int consumers = 1, ROWS = 64, PIECE = 16;
  static_assert(Tile == 128 || (D == 128 && Tile == 64), "64-key tiles at D=128 only");
  static constexpr int KV = D == 256 ? 48 : D == 128 ? Tile : 128;
  static constexpr int stages = D == 256 ? 3 : KV == 64 ? 6 : D == 64 ? 6 : 3;
  // Chained to whatever came before (balanced mode: its schedule kernel), and the merge to this one: each
  // launch overlaps the previous kernel's tail (the b1 cases are a few microseconds a kernel).
  static constexpr bool chained = true;
  using q_tile = st<T, ROWS, D>;
  using kv_tile = st<T, KV, D>;
  using piece = st<T, PIECE, D>;
  using pages_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, D, piece>;  // (blocks, heads, block_size, D)

  struct globals {
    pages_gl k, v;
    const T* q;
    long q_strides[3];
    const int *cache_seqlens, *block_table;
    int *cta_start, *work_items;  // read (reuse, balanced), or written (self_schedule; direct mode: finish)
    long bt_stride;
    gl<float, 1, RUNTIME, RUNTIME, D> partial_out;  // (1, items, rows, D)
    float* partial_lse;
    int q_len, group, block_size, causal, window_left, window_right;
    float scale_log2, softcap;
    // direct: as many CTAs as slots, CTA c runs slot c, found from the slot rule and written to work_items
    // for the merge (small batches). Otherwise (not balanced) CTA c runs [cta_start[c], cta_start[c + 1]) of the
    // step's schedule, which it works out itself when Scheduling (else an earlier call of the step left it).
    bool direct;
    schedule_rule sched;
    // single: one item per (sequence, kv head) (max_splits 1), so finish writes out and lse itself and the
    // merge kernel is not launched. Otherwise an item that is its sequence's only one this step (the step's
    // chunk covers the sequence: slot_rule::whole) does the same, and the merge skips its segment.
    bool single;
    // balanced: CTA c runs its pieces of segments [cta_start[c], cta_start[c + 1]] (balanced_rule); whole pieces
    // write out / lse, the others their slot of partial_out / partial_lse.
    bool balanced;
    balanced_rule bal;
    T* out;
    long out_strides[3];
    float* lse;  // [batch, hq, q_len]
    int hq;
  };
  struct input_block { kv_tile k, v; };
  struct scratch_block { q_tile q; };
  using s_tile = rt_fl<16, KV>;
  using row_vec = typename s_tile::per_row;
  struct consumer_state {
    rt_fl<16, D> o;
    rt<T, 16, KV> p;
    row_vec m, l, rescale;
    bool rescale_o;  // whether o must take `rescale` (lazy rescaling: no row's max moved, see RESCALE_THRESHOLD)
    const kv_tile* v_prev;
  };
  struct task_t { int item, b, h, start, end, base, len, iters; };

  // Every thread of the CTA calls it (lcsf), so self_schedule may use the whole block.
  __device__ static int2 task_range(const globals& g, int cta, int ctas) {
    if constexpr (Scheduling) {
      return self_schedule<(consumers + 1) * WARPGROUP_THREADS>(g.sched, g.work_items, g.cta_start, cta, ctas);
    } else {
      if (g.direct) return {cta, cta + 1};
      if (g.balanced) return {g.cta_start[cta], min(g.cta_start[cta + 1] + 1, g.bal.batch * g.bal.hkv)};
      return {g.cta_start[cta], g.cta_start[cta + 1]};
    }
  }
  __device__ static int task_count(const globals&) { return 0; }  // unused: task_range decides
  // After a segment's last item (or an empty slot) the walk goes straight to the next segment's first slot: a
  // segment's used slots come first, and a step's chunk can leave most of them empty (short contexts under a
  // max_model_len-wide table, or any coarsened step), each of which would otherwise cost a dependent load.
  __device__ static int next_task(const globals& g, const task_t& t, int id) {
    if (g.direct || g.balanced || (t.end > t.start && t.end < g.sched.slots.clamped(t.len))) return id + 1;
    return (id / g.sched.slots.max_splits + 1) * g.sched.slots.max_splits;
  }
  __device__ static task_t task(const globals& g, int id, int) {
    if (g.balanced) {  // the piece of segment `id` in this CTA's share; item = its slot (-1: whole)
      const int b = id / g.bal.hkv, h = id % g.bal.hkv;
      const int4 pc = g.bal.piece(blockIdx.x, b, h, g.bal.seq_at[g.bal.batch]);
      task_t t{pc.z, b, h, pc.x, pc.y, pc.x & ~(PIECE - 1), g.cache_seqlens[b], 0};
      t.iters = pc.y > pc.x ? ceil_div(pc.y - t.base, KV) : 0;
      return t;
    }
    const int4 w = g.direct ? g.sched.slots(id) : reinterpret_cast<const int4*>(g.work_items)[id];
    task_t t{id, w.x, w.y, w.z, w.w, w.z & ~(PIECE - 1), g.cache_seqlens[w.x], 0};
    t.iters = w.w > w.z ? ceil_div(w.w - t.base, KV) : 0;  // empty slots carry no work
    return t;
  }

  __device__ static void load(input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    expect_bytes(full, 2 * tma::bytes<kv_tile>());
    const int row = t.base + it * KV, last = (t.end - 1) & ~(PIECE - 1);  // pieces past the end re-read the last
    tk::attn::paged_pieces<KV / PIECE>(g.block_table + t.b * g.bt_stride, g.block_size,
                                       [&](int s) { return min(row + s * PIECE, last); },
                                       [&](int s, int page, int at_row) {
                                         const coord at{.b = page, .d = t.h, .row = at_row};
                                         tma::load_async(in.k.template row_block<PIECE>(s), g.k, at, full);
                                         tma::load_async(in.v.template row_block<PIECE>(s), g.v, at, full);
                                       });
  }

  __device__ static void init_state(consumer_state& s, int) { reset(s); }
  __device__ static void reset(consumer_state& s) {
    zero(s.o);
    fill(s.m, -INFINITY);
    zero(s.l);
  }
  __device__ static tk::attn::scoring scoring(const globals& g) { return {g.scale_log2, g.softcap}; }
  // Keys of other items (past `end`) are hidden like keys past the sequence; the query of row r is r / group.
  __device__ static tk::attn::visibility<true> visibility(const globals& g, const task_t& t) {
    return {t.end, t.len - g.q_len, g.window_left, g.window_right, g.group, bool(g.causal)};
  }

  // The packed query tile: row r = t * group + g holds q[b, t, h * group + g]; rows past q_len * group are 0.
  __device__ static void load_queries(scratch_block& scratch, const globals& g, const task_t& t) {
    constexpr int vecs_per_row = D * int(sizeof(T)) / 16;
    const int rows = g.q_len * g.group;
    for (int v = warpgroup::thread(); v < ROWS * vecs_per_row; v += WARPGROUP_THREADS) {
      const int r = v / vecs_per_row, col = (v % vecs_per_row) * (16 / int(sizeof(T)));
      uint4 x{0, 0, 0, 0};
      if (r < rows) {
        const int tok = r / g.group, head = t.h * g.group + r % g.group;
        x = *reinterpret_cast<const uint4*>(g.q + t.b * g.q_strides[0] + tok * g.q_strides[1] +
                                            head * g.q_strides[2] + col);
      }
      detail::st_shared_16B(scratch.q.ref().addr(r, col), x);
    }
    fence_async_shared();  // the tile is read by wgmma next
    warpgroup::sync(1);
  }

  // Only the packed rows q_len * group hold queries (4 or 8 of the 64 at q_len 1 and GQA groups of 4 / 8): a warp
  // with none skips the softmax (its zero queries' scores stay 0, so P = 0 and o stays 0: never written out),
  // and one with at most 8 works on the first 8 of its 16 rows (the other 8 scores stay 0 likewise).
  __device__ static void softmax(consumer_state& s, s_tile& att, const globals& g, const task_t& t, int it) {
    const int row0 = warpgroup::warp() * 16, live = g.q_len * g.group - row0;
    if (live <= 0) {
      s.rescale_o = false;
      return;
    }
    if (live <= 8)
      s.rescale_o = tk::attn::online_softmax<true, 1>(att, s.m, s.l, s.rescale, scoring(g), visibility(g, t), row0,
                                                      t.base + it * KV);
    else
      s.rescale_o = tk::attn::online_softmax<true>(att, s.m, s.l, s.rescale, scoring(g), visibility(g, t), row0,
                                                   t.base + it * KV);
  }

  __device__ static void compute_first(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                       const task_t& t, int) {
    load_queries(scratch, g, t);
    s_tile att;
    warpgroup::mm_ABt(att, scratch.q, in.k);
    warpgroup::mma_async_wait<0>();
    softmax(s, att, g, t, 0);
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = &in.v;
  }

  // Tile j: S_j and the previous tile's P V go out together; the softmax of S_j overlaps that P V.
  __device__ static void compute(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                 const task_t& t, int it, int) {
    s_tile att;
    warpgroup::mm_ABt(att, scratch.q, in.k);
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    warpgroup::mma_async_wait<1>();
    softmax(s, att, g, t, it);
    warpgroup::mma_async_wait<0>();
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = &in.v;
  }

  // Before the last P V: the tile's rows past the item's end are masked (P = 0), but at the sequence's end
  // they hold whatever the page held before, and 0 * NaN is NaN in P V, so they are zeroed first.
  __device__ static void drain(consumer_state& s, scratch_block&, const globals&, const task_t& t, int) {
    const int tail = t.end - (t.base + (t.iters - 1) * KV);
    if (tail < KV) warpgroup::zero_rows(s.v_prev->ref(), tail, 1);
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    wgmma::fence_operand(s.p);
  }

  // Row r of the item is query token r / group of head h * group + r % group: out[b, token, head, :] and
  // lse[b, head, token], each thread writing its two rows' column pairs.
  __device__ static void write_output(consumer_state& s, const globals& g, const task_t& t) {
    row_vec lse;
    tk::attn::finalize(s.o, lse, s.m, s.l, scoring(g));
    using F = frag<row_l>;
    const int rows = g.q_len * g.group, r0 = warpgroup::warp() * 16;
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int r = r0 + F::row(half, 0);  // fragment registers k = half, half + 2: rows +0 / +8
      if (r >= rows) continue;
      const int tok = r / g.group, head = t.h * g.group + r % g.group;
      T* row = g.out + t.b * g.out_strides[0] + tok * g.out_strides[1] + head * g.out_strides[2];
#pragma unroll
      for (int j = 0; j < D / 16; j++)
#pragma unroll
        for (int k = half; k < 4; k += 2)
          *reinterpret_cast<packed<T>*>(row + 16 * j + F::col(k, 0)) = convert<packed<T>>(s.o.data[0][j][k]);
      if (laneid() % 4 == 0) g.lse[(long(t.b) * g.hq + head) * g.q_len + tok] = lse.data[0][half];
    }
  }

  __device__ static void finish(consumer_state& s, scratch_block&, const globals& g, const task_t& t, int) {
    wgmma::fence_operand(s.p);
    if (g.direct && !g.single && warpgroup::thread() == 0)
      reinterpret_cast<int4*>(g.work_items)[t.item] = make_int4(t.b, t.h, t.start, t.end);
    // single: an empty item (no visible key) finalizes to out 0 and lse -inf, as the merge would.
    if (g.single || g.sched.slots.whole(t.b, t.start, t.end)) {
      write_output(s, g, t);
      reset(s);
      return;
    }
    if (t.iters > 0) {
      const int rows = g.q_len * g.group;
      row_vec lse;
      tk::attn::finalize(s.o, lse, s.m, s.l, scoring(g));
      warpgroup::store(g.partial_out, s.o, {.d = t.item}, rows);
      if (laneid() % 4 == 0) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
          const int r = warpgroup::warp() * 16 + laneid() / 4 + 8 * half;
          if (r < rows) g.partial_lse[long(t.item) * rows + r] = lse.data[0][half];
        }
      }
    }
    reset(s);
  }
};

// Balanced mode's schedule (one block): seq_at = the exclusive scan of hkv * cost_b over the batch (into the
// work_items buffer), seq_at[batch] = T, and cta_start[c] = the segment holding unit begin(c) (batch * hkv
// for every c when T = 0), cta_start[ctas] = the end of the last non-empty sequence's segments (so the last CTA
// does not walk the zero-length requests a CUDA graph pads the batch with). Sequence b's segments hold the units
// [seq_at[b], seq_at[b + 1]); the CTAs whose share begins there are ceil(x C / T) .. ceil(y C / T) - 1.
constexpr int SCHEDULE_THREADS = 512;
constexpr int BALANCED_CTAS_PER_THREAD = tk::DECODE_BALANCED_MAX_CTAS / SCHEDULE_THREADS;
static_assert(BALANCED_CTAS_PER_THREAD * SCHEDULE_THREADS == tk::DECODE_BALANCED_MAX_CTAS);

template <int ALIGN>
__global__ void __launch_bounds__(SCHEDULE_THREADS) build_balanced(tk::attn_decode_problem p) {
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

// The LSE merge's two halves, shared by both modes' merge kernels (one block per (segment, row), a thread per
// column). Warp 0, with weight[0, n) staged and m its lanes' partial maximum: the weights become
// exp(lse - max) (0 for -inf, i.e. no piece), and every lane returns (max, sum).
__device__ float2 lse_weights(float* weight, int n, float m) {
  for (int o = 16; o; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  __syncwarp();
  float sum = 0.f;
  for (int k = threadIdx.x; k < n; k += 32) {
    const float x = weight[k] == -INFINITY ? 0.f : __expf(weight[k] - m);
    weight[k] = x;
    sum += x;
  }
  for (int o = 16; o; o /= 2) sum += __shfl_xor_sync(~0u, sum, o);
  return {m, sum};
}
// The merged row out: column col is column(col) (the weighted sum of the pieces' outputs) over the weights' sum,
// and the row's LSE (-inf for a row no key reached).
template <typename T, typename Column>
__device__ void write_merged_row(const tk::attn_decode_problem& p, int b, int h, int row, int group, float row_max,
                                 float row_sum, Column column) {
  const int tok = row / group, head = h * group + row % group;
  const float inv = row_sum > 0.f ? 1.f / row_sum : 0.f;
  for (int col = threadIdx.x; col < p.head_dim; col += blockDim.x)
    static_cast<T*>(p.out)[b * p.out_strides[0] + tok * p.out_strides[1] + head * p.out_strides[2] + col] =
        kittens::convert<T>(column(col) * inv);
  if (threadIdx.x == 0)
    p.lse[(long(b) * p.hq + head) * p.q_len + tok] = row_sum > 0.f ? row_max + __logf(row_sum) : -INFINITY;
}

// Balanced mode's merge: one block per (segment, row), a thread per column. The segment's pieces lie in the
// CTAs [cta_of(at), cta_of(at + units - 1)]; warp 0 stages each one's slot and weight in shared memory (slot -1:
// no piece there), and a segment whose one piece was whole is left alone (the decode kernel wrote it).
template <typename T, int ALIGN>
__global__ void merge_balanced(tk::attn_decode_problem p, int group) {
  extern __shared__ int staged[];  // [2 * (ctas + 1)]: slots, then weights (as float bits)
  __shared__ float row_max, row_sum;
  __shared__ int count, whole;
  chain::wait();  // launched chained to the decode kernel: its pieces are complete from here on
  const balanced_rule r = balanced_rule_of<ALIGN>(p);
  const int rows = p.q_len * group, seg = blockIdx.x / rows, row = blockIdx.x % rows;
  const int b = seg / p.hkv, h = seg % p.hkv, span = p.num_ctas + 1;
  float* weight = reinterpret_cast<float*>(staged + span);
  if (threadIdx.x < 32) {
    const long long total = r.seq_at[p.batch], units = r.cost(r.visible(b));
    int c0 = 0, n = 0;
    if (units > 0) {
      const long long at = r.seq_at[b] + h * units;
      c0 = r.cta_of(at, total), n = r.cta_of(at + units - 1, total) - c0 + 1;
    }
    float m = -INFINITY;
    bool is_whole = false;
    for (int k = threadIdx.x; k < n; k += 32) {
      const int4 pc = r.piece(c0 + k, b, h, total);
      const bool live = pc.y > pc.x;
      is_whole |= live && pc.z < 0;
      staged[k] = live && pc.z >= 0 ? pc.z : -1;
      weight[k] = staged[k] >= 0 ? p.partial_lse[long(staged[k]) * rows + row] : -INFINITY;
      m = fmaxf(m, weight[k]);
    }
    is_whole = __any_sync(~0u, is_whole);
    const float2 ms = lse_weights(weight, n, m);
    if (threadIdx.x == 0) row_max = ms.x, row_sum = ms.y, count = n, whole = is_whole;
  }
  __syncthreads();
  if (whole) return;  // written by the decode kernel
  write_merged_row<T>(p, b, h, row, group, row_max, row_sum, [&](int col) {
    float acc = 0.f;
    for (int k = 0; k < count; k++)
      if (weight[k] > 0.f) acc += weight[k] * p.partial_out[(long(staged[k]) * rows + row) * p.head_dim + col];
    return acc;
  });
}

// merge_partials' weights in shared memory: whole float4s, because ptxas reads the unrolled sum's tail as one
// 16-byte load (compute-sanitizer flagged the over-read). The padding holds -inf: never a weight.
constexpr int merge_weights(int max_splits) { return (max_splits + 3) / 4 * 4; }

// The LSE merge of a segment's items: one block per (sequence, kv head, row), a thread per column. The
// items' LSEs are staged in shared memory once; then each thread sums its column over the items.
template <typename T>
__global__ void merge_partials(tk::attn_decode_problem p, int group) {
  extern __shared__ float weight[];  // [merge_weights(max_splits)]
  __shared__ float row_max, row_sum;
  chain::wait();  // launched chained to the decode kernel: its items are complete from here on
  const int rows = p.q_len * group, seg = blockIdx.x / rows, r = blockIdx.x % rows;
  const int b = seg / p.hkv, h = seg % p.hkv, first = seg * p.max_splits;
  const int4 lead = reinterpret_cast<const int4*>(p.work_items)[first];
  if (slot_rule_of(p).whole(b, lead.z, lead.w)) return;  // the decode kernel wrote this segment's rows
  for (int s = threadIdx.x; s < merge_weights(p.max_splits); s += blockDim.x) {
    weight[s] = -INFINITY;
    if (s >= p.max_splits) continue;
    const int4 w = reinterpret_cast<const int4*>(p.work_items)[first + s];
    if (w.w > w.z) weight[s] = p.partial_lse[long(first + s) * rows + r];
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    float m = -INFINITY;
    for (int s = threadIdx.x; s < p.max_splits; s += 32) m = fmaxf(m, weight[s]);
    const float2 ms = lse_weights(weight, p.max_splits, m);
    if (threadIdx.x == 0) row_max = ms.x, row_sum = ms.y;
  }
  __syncthreads();
  write_merged_row<T>(p, b, h, r, group, row_max, row_sum, [&](int col) {
    float acc = 0.f;
    if (row_sum > 0.f) {
#pragma unroll 4
      for (int s = 0; s < p.max_splits; s++)
        if (weight[s] > 0.f) acc += weight[s] * p.partial_out[(long(first + s) * rows + r) * p.head_dim + col];
    }
    return acc;
  });
}

template <typename T, int D, int Tile, bool Scheduling>
void launch(const tk::attn_decode_problem& p, cudaStream_t stream) {
  using K = attn_decode_split<T, D, Tile, Scheduling>;
  auto ptr = [](const void* x) { return static_cast<T*>(const_cast<void*>(x)); };
  const int group = p.hq / p.hkv, rows = p.q_len * group;
  typename K::globals g{};
  g.k = {ptr(p.k), {p.num_blocks, p.hkv, p.block_size, D}, {p.k_strides[0], p.k_strides[2], p.k_strides[1], 1}};
  g.v = {ptr(p.v), {p.num_blocks, p.hkv, p.block_size, D}, {p.v_strides[0], p.v_strides[2], p.v_strides[1], 1}};
  g.q = ptr(p.q);
  for (int i = 0; i < 3; i++) g.q_strides[i] = p.q_strides[i];
  g.cache_seqlens = p.cache_seqlens;
  g.block_table = p.block_table;
  g.bt_stride = p.bt_stride;
  g.work_items = p.work_items;
  g.cta_start = p.cta_start;
  g.partial_out = {p.partial_out, {1, p.max_items, rows, D}};
  g.partial_lse = p.partial_lse;
  g.q_len = p.q_len;
  g.group = group;
  g.block_size = p.block_size;
  g.causal = p.causal;
  g.window_left = p.window_left;
  g.window_right = p.window_right;
  g.scale_log2 = p.softmax_scale * tk::attn::LOG2E;
  g.softcap = p.softcap;
  g.sched = schedule_rule_of(p);
  g.balanced = p.balanced;
  g.bal = balanced_rule_of<K::KV>(p);
  g.direct = !p.balanced && p.max_items <= p.num_ctas;  // one slot per CTA: nothing to balance
  g.single = !p.balanced && p.max_splits == 1;
  g.out = static_cast<T*>(p.out);
  for (int i = 0; i < 3; i++) g.out_strides[i] = p.out_strides[i];
  g.lse = p.lse;
  g.hq = p.hq;
  if (g.balanced) {
    if (!p.reuse_schedule) {
      build_balanced<K::KV><<<1, SCHEDULE_THREADS, 0, stream>>>(p);
      TK_LAUNCH_CHECK();
    }
    lcsf::launch<K>(g, p.num_ctas, stream);
    chain::launch(merge_balanced<T, K::KV>, p.batch * p.hkv * rows, D, 2 * (p.num_ctas + 1) * sizeof(int), stream, p,
                  group);
    return;
  }
  lcsf::launch<K>(g, g.direct ? p.max_items : p.num_ctas, stream);
  if (g.single) return;
  chain::launch(merge_partials<T>, p.batch * p.hkv * rows, D, merge_weights(p.max_splits) * sizeof(float), stream, p,
                group);
}

template <typename T, int D, int Tile = 128>
void run(const tk::attn_decode_problem& p, cudaStream_t stream) {
  const bool direct = !p.balanced && p.max_items <= p.num_ctas;
  if (!p.balanced && !direct && !p.reuse_schedule) return launch<T, D, Tile, true>(p, stream);
  launch<T, D, Tile, false>(p, stream);
}

template <typename T>
void run_dtype(const tk::attn_decode_problem& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return run<T, 64>(p, stream);
    case 128: return p.kv_tile == 64 ? run<T, 128, 64>(p, stream) : run<T, 128>(p, stream);
    case 256: return run<T, 256>(p, stream);
  }
}

}  // namespace

namespace tk {

void attn_decode(const attn_decode_problem& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  if (p.type == dtype::bf16) run_dtype<bf16>(p, stream);
  else run_dtype<half>(p, stream);
}

}  // namespace tk
