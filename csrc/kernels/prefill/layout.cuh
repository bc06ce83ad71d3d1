// Prefill's types for one policy: tiles, global layouts, the ring's input blocks, scratch and per-consumer state.
#pragma once
#include <type_traits>
#include <variant>
#include "../../kittens/kittens.cuh"
#include "../attention/masks.cuh"
#include "../attention/softmax.cuh"
#include "policy.cuh"

namespace tk::prefill {

using namespace kittens;

template <typename T, policy P>
struct prefill_layout {
  static constexpr policy config = P;
  using element = T;
  static_assert(P.consumers == 2 || (P.consumers == 3 && P.head_dim <= 128), "two consumers, or three at D <= 128");
  static constexpr int D = P.head_dim, consumers = P.consumers, stages = P.stages, QROWS = 64, BQ = consumers * QROWS;
  static constexpr int KV = P.kv_rows, HALF = KV / 2, PAGE_PIECE = 16;  // 16 divides every supported page size
  static constexpr bool serial = P.order == tile_order::serial, staggered = P.ring == kv_ring::staggered;
  static constexpr int SLOTS = staggered ? 2 : 1;  // ring slots a K/V tile takes
  // A serial consumer's stage is free once its P V is done (release lag 0), so two stages keep a tile in flight.
  static constexpr lcsf::options pipeline{
      .release_lag = serial ? 0 : 1,
      .ring = staggered ? lcsf::ring_layout::staggered_pairs : lcsf::ring_layout::single,
      .walk = P.walk};
  static constexpr bool fresh_first = P.first != first_tile::exact, seeded_first = P.first == first_tile::seeded;
  static_assert(!P.warp_epilogue || P.queries_ahead, "warp_epilogue: the output's own staging buffer (queries_ahead)");
  static_assert(!P.half_last || (P.trims && seeded_first), "half_last: a consumer's own tiles (trims), seeded");
  static_assert(!P.skip_hidden || P.mask_once, "skip_hidden: the task's mask span (mask_once)");
  static_assert(!P.half_ends || (serial && KV % 32 == 0), "half_ends: the serial order's tiles, whole k-steps a half");

  static constexpr int COLS = P.ragged_head_dim ? RUNTIME : D;  // the global layouts' head dim
  using q_tile = st<T, QROWS, D>;
  using kv_tile = st<T, KV, D>;
  using page_piece = st<T, PAGE_PIECE, D>;
  using out_rows = st<T, 16, D>;
  using tokens_gl = gl<T, 1, RUNTIME, RUNTIME, COLS, q_tile>;  // (1, heads, tokens, head dim)
  using out_gl = std::conditional_t<P.warp_epilogue, gl<T, 1, RUNTIME, RUNTIME, COLS, q_tile, out_rows>, tokens_gl>;
  using kv_gl = gl<T, 1, RUNTIME, RUNTIME, COLS, kv_tile>;              // (1, heads, tokens, head dim)
  using pages_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, COLS, page_piece>;  // (blocks, heads, block_size, head dim)

  struct globals {
    tokens_gl q;
    out_gl o;
    kv_gl k, v;
    pages_gl k_pages, v_pages;
    float* lse;
    long lse_stride;
    const int *cu_q, *cu_k, *seqused_k, *block_table;
    long bt_stride;
    int batch, hq, group, q_blocks, block_size, paged, causal, window_left, window_right;
    int heads_per_group;  // (sequence, head) pairs whose K/V fit in L2 together (prefill_scheduler::task)
    // The task's and loads' divisions by launch-fixed values, as a multiply and a shift: the grid, a group's tasks,
    // its heads (the last group's may be fewer), the query heads, and the query heads a kv head serves.
    divisor ctas_div, per_group_div, group_heads_div, last_group_heads_div, hq_div, group_div;
    float scale_log2, softcap;  // softcap > 0: scores = softcap * tanh(qk * scale / softcap)
    int* task_counter;          // task_walk::claimed
    divisor block_size_div;     // paged, page_divisor: a page's tokens
    const float* sinks;         // P.sinks: [hq] float32
  };
  struct kv_pair { kv_tile k, v; };
  struct kv_slot { kv_tile kv; };  // staggered: K_j in an even slot, V_j in the next
  using input_block = std::conditional_t<staggered, kv_slot, kv_pair>;
  // A step's K_j, and the V_j its P_j V_j will use one step later.
  __device__ static const kv_tile& k_of(const input_block& in) {
    if constexpr (staggered) return in.kv;
    else return in.k;
  }
  __device__ static const kv_tile* v_of(const input_block& in) {
    if constexpr (staggered) return &(&in)[1].kv;  // the ring slot after K_j's
    else return &in.v;
  }
  // K_j's Cols rows (keys) from row block `block` on: all of them, or a half tile's (block 0: the first half).
  template <int Cols> __device__ static auto keys(const input_block& in, int block = 0) {
    if constexpr (Cols == KV) return k_of(in).ref();
    else return k_of(in).template row_block<Cols>(block);
  }
  // ... and V_j's.
  template <int Cols> __device__ static auto values(const input_block& in, int block = 0) {
    if constexpr (Cols == KV) return v_of(in)->ref();
    else return v_of(in)->template row_block<Cols>(block);
  }

  static_assert(!P.queries_ahead || stages * sizeof(input_block) + 2 * consumers * sizeof(q_tile) <= 224 * 1024);
  struct scratch_ahead {
    q_tile q[consumers], o[consumers];
    semaphore q_ready[consumers], q_free[consumers];
    unsigned q_free_phases;  // the producer's: bit c, the phase of q_free[c] it waits for next (flipped)
  };
  struct scratch_own {
    q_tile q[consumers];  // this task's queries; the output is staged here on the way out
    semaphore q_ready[consumers];
  };
  using scratch_block = std::conditional_t<P.queries_ahead, scratch_ahead, scratch_own>;

  using s_tile = rt_fl<16, KV>;
  using row_vec = typename s_tile::per_row;
  struct consumer_state {
    rt_fl<16, D> o;
    rt<T, 16, KV> p;        // the previous tile's probabilities, waiting for their P V
    row_vec m, l;           // running row max (score units) and row sum
    row_vec rescale;        // factor o must take before the previous tile's P V is added
    bool rescale_o;         // whether any row's is not 1 (warp-uniform; see tk::attn::RESCALE_THRESHOLD)
    const kv_tile* v_prev;  // that tile's V: its stage stays held until the current compute returns
    int q_phase;
    int seen_lo, seen_hi;   // serial: the task's tiles [seen_lo, seen_hi) hold keys this consumer's rows see
                            // (half_ends: its half tiles, HALF keys each; tile j holds halves 2j and 2j + 1)
    int own;                // trims: the task's tiles this consumer computes (own_iters)
    bool half;              // half_last: the last of them is a half tile (its rows see none of its last HALF keys)
    // Which of the task's tiles this warp's rows mask (compute_first), where mask_once.
    [[no_unique_address]] std::conditional_t<P.mask_once, tk::attn::visibility<>::span, std::monostate> mask;
  };
  struct task_t {
    int b, h, row0, q0, lq, k0, lk, lo, first, iters;  // row0: the block's first query row (< 0: see task)
    // lo: the first key any of the task's queries sees
    // iters: ring slots, SLOTS a K/V tile
    bool valid;
  };
  // The consumers take turns issuing their matrix products, round robin (barriers TURN + consumer, after the
  // warpgroups' own 1..consumers), so one's softmax runs while another's products keep the tensor cores busy.
  static constexpr int TURN = 1 + consumers, BOTH = 2 * WARPGROUP_THREADS;
  __device__ static int next_turn(int wg) { return TURN + (wg + 1 == consumers ? 0 : wg + 1); }

  // softcap = false: launched without a softcap (its code compiled out).
  __device__ static tk::attn::scoring scoring(const globals& g) { return {g.scale_log2, P.softcap ? g.softcap : 0.f}; }
  // Accumulators start each task empty; finish puts them back (no non-wgmma writes to them mid-pipeline).
  __device__ static void reset_accumulators(consumer_state& s) {
    zero(s.o);
    fill(s.m, -INFINITY);
    zero(s.l);
  }
};

}  // namespace tk::prefill
