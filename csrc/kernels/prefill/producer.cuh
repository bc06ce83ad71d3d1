// Prefill's producer: K/V tiles into the ring (one TMA box a tile for packed K/V, one a 16-row page piece for paged
// caches) and, with queries_ahead, each consumer's queries for its next task.
#pragma once
#include "../attention/paging.cuh"
#include "scheduler.cuh"

namespace tk::prefill {

template <typename L>
struct prefill_producer {
  static constexpr policy P = L::config;
  static constexpr int KV = L::KV, SLOTS = L::SLOTS, PAGE_PIECE = L::PAGE_PIECE, QROWS = L::QROWS;
  static constexpr bool staggered = L::staggered;
  using globals = typename L::globals;
  using task_t = typename L::task_t;
  using S = prefill_scheduler<L>;

  // The page size paged_pieces divides by: a divisor (page_divisor), else the plain int.
  __device__ static auto paged_block(const globals& g) {
    if constexpr (P.page_divisor) return g.block_size_div;
    else return g.block_size;
  }
  // Slot `it`: K/V tile it (a pair), or staggered K (even slot) or V (odd) of tile it / 2.
  __device__ static void load(typename L::input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    const int row = (t.first + it / SLOTS) * KV, kv_head = g.group_div.div(t.h);
    expect_bytes(full, (staggered ? 1 : 2) * tma::bytes<typename L::kv_tile>());
    if (!g.paged) {
      if constexpr (staggered) {  // a branch, not a select of the layouts: their descriptors stay in parameter space
        if (it & 1) tma::load_async(in.kv, g.v, {.d = kv_head, .row = t.k0 + row}, full);
        else tma::load_async(in.kv, g.k, {.d = kv_head, .row = t.k0 + row}, full);
      } else {
        tma::load_async(in.k, g.k, {.d = kv_head, .row = t.k0 + row}, full);
        tma::load_async(in.v, g.v, {.d = kv_head, .row = t.k0 + row}, full);
      }
      return;
    }
    // Pieces past the end re-read the last one, pieces before the window the window's first: every page read
    // belongs to the sequence (a sliding-window cache may have recycled the pages behind the window).
    const int last_piece = (t.lk - 1) / PAGE_PIECE * PAGE_PIECE, first_piece = t.lo / PAGE_PIECE * PAGE_PIECE;
    tk::attn::paged_pieces<KV / PAGE_PIECE>(
        g.block_table + t.b * g.bt_stride, paged_block(g),
        [&](int s) { return max(min(row + s * PAGE_PIECE, last_piece), first_piece); },
        [&](int s, int page, int at_row) {
          const coord at{.b = page, .d = kv_head, .row = at_row};
          if constexpr (staggered) {
            if (it & 1) tma::load_async(in.kv.template row_block<PAGE_PIECE>(s), g.v_pages, at, full);
            else tma::load_async(in.kv.template row_block<PAGE_PIECE>(s), g.k_pages, at, full);
          } else {
            tma::load_async(in.k.template row_block<PAGE_PIECE>(s), g.k_pages, at, full);
            tma::load_async(in.v.template row_block<PAGE_PIECE>(s), g.v_pages, at, full);
          }
        });
  }

  // queries_ahead: each consumer's queries for task t, once it has freed the buffer (its last S of the task before).
  __device__ static void load_task_inputs(typename L::scratch_block& scratch, const globals& g, const task_t& t)
    requires(P.queries_ahead)
  {
    unsigned phases = scratch.q_free_phases;
#pragma unroll
    for (int c = 0; c < L::consumers; c++) {
      if (!S::reads_queries(t, c)) continue;
      wait(scratch.q_free[c], ((phases >> c) & 1) ^ 1);  // a fresh semaphore passes at once
      phases ^= 1u << c;
      expect_bytes(scratch.q_ready[c], tma::bytes<typename L::q_tile>());
      // A consumer whose rows lie before its sequence's start loads some (clamped into the tensor); it writes none.
      tma::load_async(scratch.q[c], g.q, {.d = t.h, .row = max(t.q0 + t.row0 + c * QROWS, 0)}, scratch.q_ready[c]);
    }
    scratch.q_free_phases = phases;
  }
};

}  // namespace tk::prefill
