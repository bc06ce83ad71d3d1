// Prefill's tasks: which (sequence, query head, query block) a task id is, the L2-aware order, and which keys a
// task's consumers see.
#pragma once
#include <algorithm>
#include "layout.cuh"

namespace tk::prefill {

template <typename L>
struct prefill_scheduler {
  static constexpr policy P = L::config;
  static constexpr int QROWS = L::QROWS, BQ = L::BQ, KV = L::KV, SLOTS = L::SLOTS;
  using globals = typename L::globals;
  using task_t = typename L::task_t;

  __device__ static int task_count(const globals& g) { return g.q_blocks * g.batch * g.hq; }
  // Task order, L2-aware: (sequence, head) pairs go in groups of heads_per_group, whose K/V fit in L2 together;
  // within a group the query blocks go latest (longest under a causal mask) first, the group's heads interleaved,
  // so the CTAs running at once stream the same few heads' K/V from L2 (head-major order would give every CTA its
  // own head and make the kernel HBM-bound). task_order::turned_waves: see policy.cuh.
  __device__ static task_t task(const globals& g, int id, int) {
    task_t t;
    if constexpr (P.tasks == task_order::turned_waves) {
      // ptxas's allocation is fragile here: written wave * ctas + ctas - 1 - ..., the D=64 consumers spilled.
      const int ctas = gridDim.x, wave = g.ctas_div.div(id), at = id - wave * ctas;
      if ((wave + 1) * ctas <= task_count(g)) {
        if (g.causal) {
          if (wave & 1) id = wave * ctas + (ctas - 1) - at;
        } else {
          int r = at + g.ctas_div.mod(wave * g.heads_per_group);
          if (r >= ctas) r -= ctas;
          id = wave * ctas + r;
        }
      }
    }
    const int heads = g.batch * g.hq, per_group = g.heads_per_group * g.q_blocks;
    const int group = g.per_group_div.div(id), first = group * g.heads_per_group, in_group = id - group * per_group;
    const divisor& group_heads = heads - first < g.heads_per_group ? g.last_group_heads_div : g.group_heads_div;
    const int qb = g.q_blocks - 1 - group_heads.div(in_group);
    const int pair = first + group_heads.mod(in_group);  // consecutive q heads share a kv head under GQA
    t.b = g.hq_div.div(pair);
    t.h = pair - t.b * g.hq;
    t.q0 = g.cu_q[t.b];
    t.lq = g.cu_q[t.b + 1] - t.q0;
    t.lk = g.seqused_k ? g.seqused_k[t.b] : g.cu_k[t.b + 1] - g.cu_k[t.b];
    t.k0 = g.paged ? 0 : g.cu_k[t.b];
    // Query blocks align to the sequence's end (rounded up to QROWS rows): block qb ends q_blocks - 1 - qb blocks
    // before it. A ragged sequence then has its short block first, where under a causal mask it sees the fewest
    // keys; consumers whose rows all lie before the sequence's start (row0 < 0) have nothing to write. A
    // consumer's rows start at a multiple of QROWS, so none straddles the start; only the last can straddle the end.
    t.row0 = ceil_div(t.lq, QROWS) * QROWS - (g.q_blocks - qb) * BQ;
    t.valid = t.row0 + BQ > 0;
    const auto [begin, end] = key_range(g, t, t.row0, BQ);
    t.lo = begin;
    t.first = begin / KV;
    t.iters = (t.valid && end > begin) ? SLOTS * (ceil_div(end, KV) - t.first) : 0;
    return t;
  }
  struct keys_t { int begin, end; };
  // The keys queries row_lo .. row_lo + rows - 1 of a task's sequence see (those past its end see none).
  __device__ static keys_t key_range(const globals& g, const task_t& t, int row_lo, int rows) {
    const int offset = t.lk - t.lq;  // bottom-right alignment
    // The block's last row is taken before row_lo is clamped: a ragged first block's rows before the start see
    // nothing.
    const int row_hi = min(t.lq, row_lo + rows) - 1;
    row_lo = max(row_lo, 0);
    int begin = 0, end = t.lk;
    if (g.window_left >= 0) begin = max(0, row_lo + offset - g.window_left);
    if (g.causal) end = min(end, row_hi + offset + 1);
    if (g.window_right >= 0) end = min(end, row_hi + offset + g.window_right + 1);
    return {begin, end};
  }
  __device__ static tk::attn::visibility<> visibility(const globals& g, const task_t& t) {
    return {t.lk, t.lk - t.lq, g.window_left, g.window_right, 1, bool(g.causal)};
  }
  // The first of this warp's 16 rows of the task's queries.
  __device__ static int rows_of(const task_t& t, int wg) { return t.row0 + wg * QROWS + warpgroup::warp() * 16; }
  // A consumer whose 64 rows all lie before the sequence's start (the first block of a ragged sequence) or past
  // its end loads and computes nothing, in the kernels that can sit tiles out (serial, trims).
  __device__ static bool idle(const task_t& t, int wg) {
    const int r0 = t.row0 + wg * QROWS;
    return (L::serial || P.trims) && (r0 >= t.lq || r0 < 0);
  }
  // A consumer reads queries in a task (and frees them after its last S) iff it has rows and the task has keys.
  __device__ static bool reads_queries(const task_t& t, int wg) { return t.iters > 0 && !idle(t, wg); }
  // The end of the keys this consumer's rows see.
  __device__ static int last_keys(const globals& g, const task_t& t, int wg) {
    return key_range(g, t, t.row0 + wg * QROWS, QROWS).end;
  }
  // trims: the task's tiles up to the last one this consumer's rows see (lcsf's own_iters).
  __device__ static int own_iters(const globals& g, const task_t& t, int wg)
    requires(P.trims)
  {
    if (t.iters == 0 || idle(t, wg)) return 0;
    return min(t.iters, max(1, ceil_div(last_keys(g, t, wg), KV) - t.first));
  }
  // The last of the task's tiles this consumer computes (-1: none).
  __device__ static int last_tile(const typename L::consumer_state& s, const task_t& t) {
    if constexpr (P.trims) return s.own - 1;
    else if constexpr (P.half_ends) return (s.seen_hi + 1) / 2 - 1;  // seen_hi counts half tiles
    else if constexpr (L::serial) return s.seen_hi - 1;
    else return t.iters / SLOTS - 1;
  }
};

// How many (sequence, q head) pairs go in one L2 group (prefill_scheduler::task): at most the pairs whose K/V fit
// in half of L2 (q heads of one kv head share its K/V), and without a causal mask at most the pairs whose query
// blocks make one wave of the grid (a group of several waves re-streams its heads' K/V once a wave).
inline int heads_per_l2_group(const tk::attn_varlen_problem& p, int head_dim, int q_blocks, int ctas) {
  int device = 0, l2_bytes = 0;
  TK_CUDA_CHECK(cudaGetDevice(&device));
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const long kv_bytes = std::max<long>(1, long(p.max_seqlen_k) * head_dim * 2 * 2);  // K and V, 16-bit
  const long kv_heads = std::max<long>(1, (l2_bytes / 2) / kv_bytes);
  const long pairs = long(p.batch) * p.hq, gqa = std::max(1, p.hq / p.hkv);
  const long one_wave = p.causal ? pairs : std::max(1, ctas / std::max(1, q_blocks));
  return int(std::clamp<long>(std::min(kv_heads * gqa, one_wave), 1, pairs));
}

}  // namespace tk::prefill
