// Prefill's consumers: S = Q K^T on tensor cores, the online softmax in exp2 with the scale folded in (masks only on
// tiles that need them), then O += P V with P straight from registers. The consumers take turns on the tensor
// cores; overlapped ones run a tile's softmax under their previous tile's P V, serial ones a tile at a time.
#pragma once
#include <climits>
#include "scheduler.cuh"

namespace tk::prefill {

template <typename L>
struct prefill_consumer {
  static constexpr policy P = L::config;
  static constexpr int KV = L::KV, HALF = L::HALF, SLOTS = L::SLOTS, QROWS = L::QROWS, TURN = L::TURN,
                       BOTH = L::BOTH;
  static constexpr bool serial = L::serial;
  using globals = typename L::globals;
  using task_t = typename L::task_t;
  using input_block = typename L::input_block;
  using scratch_block = typename L::scratch_block;
  using consumer_state = typename L::consumer_state;
  using s_tile = typename L::s_tile;
  using S = prefill_scheduler<L>;

  __device__ static void init_scratch(scratch_block& s) {
    for (int c = 0; c < L::consumers; c++) init_semaphore(s.q_ready[c], 1);
    if constexpr (P.queries_ahead) {
      for (int c = 0; c < L::consumers; c++) init_semaphore(s.q_free[c], P.warp_epilogue ? WARPGROUP_WARPS : 1);
      s.q_free_phases = 0;
    }
  }
  __device__ static void init_state(consumer_state& s, int wg) {
    L::reset_accumulators(s);
    s.q_phase = 0;
    s.v_prev = nullptr;
    if (wg == L::consumers - 1) warpgroup::arrive_at(TURN + 0, BOTH);  // consumer 0 goes first
  }

  // Online softmax of one score tile in place (att becomes the unnormalised probabilities); updates the running max
  // and sum and leaves in s.rescale the factor the accumulated output must take. Later: a task's later tiles (their
  // fast step recomputes S from K's stage and the queries, still held), else its first. att holds the tile's keys
  // from its Tile::cols-key block `block` on (a half tile's: see keys).
  template <bool Later, typename Tile>
  __device__ static void softmax(consumer_state& s, Tile& att, scratch_block& scratch, const input_block& in,
                                 const globals& g, const task_t& t, int it, int wg, int block = 0) {
    const int row0 = S::rows_of(t, wg), col0 = (t.first + it) * KV + block * Tile::cols;
    const auto vis = S::visibility(g, t);
    const auto masked = [&] {
      if constexpr (P.mask_once) return s.mask.masks(col0);
      else return vis.partial(row0, Tile::rows, col0, Tile::cols);
    };
    const auto recompute = [&](Tile& a) {
      warpgroup::mm_ABt(a, scratch.q[wg], L::template keys<Tile::cols>(in, block));
      warpgroup::mma_async_wait<0>();
    };
    const auto group_all = [wg](bool pred) { return warpgroup::all(1 + wg, pred); };
    constexpr bool fresh = !Later && L::fresh_first, fast = (Later || L::seeded_first) && P.fast_softmax;
    if constexpr (P.skip_hidden) {
      if (s.mask.hides(col0)) {  // no key of the tile is visible to this warp's rows: P = 0, m and l stay
        s.rescale_o = false;
        if constexpr (fast) {
          if (!group_all(true)) {  // the group's recompute: every warp issues it, and its result must stay live
            recompute(att);
            map(att, att, [](float x) { return 0.f * x; });
            return;
          }
        }
        zero(att);
        return;
      }
    }
    constexpr tk::attn::softmax_step step{
        .lazy_rescale = P.lazy_rescale, .fast = fast, .fast_needs_seen = P.fast_needs_seen, .fresh = fresh};
    s.rescale_o = tk::attn::online_softmax<step>(att, s.m, s.l, s.rescale, L::scoring(g), vis, row0, col0, masked,
                                                 recompute, group_all);
  }

  // After the task's last S: the queries' buffer may take the next task's.
  __device__ static void free_queries(scratch_block& scratch, const consumer_state& s, const task_t& t, int it, int wg) {
    if constexpr (P.queries_ahead) {
      if (it != S::last_tile(s, t)) return;
      release_queries(scratch, wg);
    }
  }
  __device__ static void release_queries(scratch_block& scratch, int wg)
    requires(P.queries_ahead)
  {
    if constexpr (P.warp_epilogue) {  // each warp, once its part of S has read them
      __syncwarp();
      if (laneid() == 0) arrive(scratch.q_free[wg]);
      return;
    }
    warpgroup::sync(1 + wg);  // every warp's part of S has read them
    if (warpgroup::thread() == 0) arrive(scratch.q_free[wg]);
  }

  // A task's first tile: the queries (loaded here unless queries_ahead), then S_0 alone.
  __device__ static void compute_first(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                       const task_t& t, int wg) {
    if constexpr (P.trims) s.own = S::own_iters(g, t, wg);
    if constexpr (P.half_last) s.half = s.own > 1 && S::last_keys(g, t, wg) - (t.first + s.own - 1) * KV <= HALF;
    if constexpr (P.mask_once) {
      const int row0 = S::rows_of(t, wg);
      s.mask = S::visibility(g, t).mask_span(row0, s_tile::rows, KV);
      if (P.skip_hidden && (row0 >= t.lq || row0 + s_tile::rows <= 0)) s.mask.hidden_after = INT_MIN;  // no output
    }
    if (S::reads_queries(t, wg)) {
      if (!P.queries_ahead && warpgroup::thread() == 0) {
        tma::store_wait_read<0>();  // the previous task's output has left the buffer
        expect_bytes(scratch.q_ready[wg], tma::bytes<typename L::q_tile>());
        tma::load_async(scratch.q[wg], g.q, {.d = t.h, .row = max(t.q0 + t.row0 + wg * QROWS, 0)}, scratch.q_ready[wg]);
      }
      wait(scratch.q_ready[wg], s.q_phase);
      s.q_phase ^= 1;
    }
    if constexpr (serial) {
      s.seen_lo = s.seen_hi = 0;
      if (!S::idle(t, wg)) {
        const auto [begin, end] = S::key_range(g, t, t.row0 + wg * QROWS, QROWS);
        if (end > begin) {
          if constexpr (P.half_ends) {  // in half tiles
            s.seen_lo = begin / HALF - 2 * t.first;
            s.seen_hi = ceil_div(end, HALF) - 2 * t.first;
          } else {
            s.seen_lo = begin / KV - t.first;
            s.seen_hi = ceil_div(end, KV) - t.first;
          }
        }
      }
      if constexpr (P.queries_ahead) {  // queries read, but no key seen (lk < lq): no S will free them
        if (s.seen_hi == 0 && S::reads_queries(t, wg)) release_queries(scratch, wg);
      }
      serial_tile</*Later=*/false>(s, in, scratch, g, t, 0, wg);
      return;
    }
    s_tile att;
    warpgroup::sync_with(TURN + wg, BOTH);
    warpgroup::mm_ABt(att, scratch.q[wg], L::k_of(in));
    warpgroup::arrive_at(L::next_turn(wg), BOTH);
    warpgroup::mma_async_wait<0>();
    if constexpr (!L::seeded_first) free_queries(scratch, s, t, 0, wg);
    softmax</*Later=*/false>(s, att, scratch, in, g, t, 0, wg);
    if constexpr (L::seeded_first) free_queries(scratch, s, t, 0, wg);  // after the softmax, which may run S_0 again
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = L::v_of(in);
  }

  // Tile j: S_j = Q K_j^T and the previous tile's O += P_{j-1} V_{j-1} are issued together in this consumer's turn;
  // the softmax of S_j then runs while P_{j-1} V_{j-1} (and the other consumers) compute. (Staggered, lcsf calls this
  // once a K/V tile, `it` = j, with K_j's slot; V_{j-1}'s is held too.)
  __device__ static void compute(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                 const task_t& t, int it, int wg) {
    if constexpr (serial) {
      serial_tile</*Later=*/true>(s, in, scratch, g, t, it, wg);
      return;
    }
    if constexpr (P.half_last) {
      if (s.half && it == s.own - 1) return overlapped_tile<HALF>(s, in, scratch, g, t, it, wg);
    }
    overlapped_tile<KV>(s, in, scratch, g, t, it, wg);
  }
  // The overlapped order's tile `it` on its first Cols keys (KV, or HALF: see half_last).
  template <int Cols>
  __device__ static void overlapped_tile(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                         const task_t& t, int it, int wg) {
    rt_fl<16, Cols> att;
    warpgroup::sync_with(TURN + wg, BOTH);
    warpgroup::mm_ABt(att, scratch.q[wg], L::template keys<Cols>(in));
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);  // o is idle here: only S_j is in flight
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);  // the previous tile is a whole one (a half tile is a consumer's last)
    warpgroup::arrive_at(L::next_turn(wg), BOTH);
    warpgroup::mma_async_wait<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
    softmax</*Later=*/true>(s, att, scratch, in, g, t, it, wg);
    free_queries(scratch, s, t, it, wg);  // after the softmax, which may run S_j again
    warpgroup::mma_async_wait<0>();  // P_{j-1} V_{j-1} is done: p is free
    wgmma::fence_operand(s.p);
    copy_leading(s.p, att);
    s.v_prev = L::v_of(in);
  }

  // Serial order: tile `it`'s scores, softmax and P V, all done on return; a consumer skips the tiles none of its
  // rows sees (seen_lo / seen_hi), keeping its turn, and with half_ends runs the half of a tile its rows see alone.
  template <bool Later>
  __device__ static void serial_tile(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                     const task_t& t, int it, int wg) {
    warpgroup::sync_with(TURN + wg, BOTH);
    if constexpr (P.half_ends) {
      // The tile's halves [lo, hi) that this consumer's rows see: both, one (the first of its tiles may start at the
      // second half, the last end at the first), or none.
      const int lo = max(s.seen_lo - 2 * it, 0), hi = min(s.seen_hi - 2 * it, 2);
      if (hi - lo == 1) return serial_keys<Later, HALF>(s, in, scratch, g, t, it, wg, lo);
      if (hi - lo == 2) return serial_keys<Later, KV>(s, in, scratch, g, t, it, wg);
      warpgroup::arrive_at(L::next_turn(wg), BOTH);
      return;
    }
    if (it < s.seen_lo || it >= s.seen_hi) {
      warpgroup::arrive_at(L::next_turn(wg), BOTH);
      return;
    }
    serial_keys<Later, KV>(s, in, scratch, g, t, it, wg);
  }
  // ... on the tile's Cols keys from its Cols-key block `block` on, in this consumer's turn. Its rows past the
  // sequence's end are zeroed in V first on the last tile (see drain).
  template <bool Later, int Cols>
  __device__ static void serial_keys(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                     const task_t& t, int it, int wg, int block = 0) {
    rt_fl<16, Cols> att;
    warpgroup::mm_ABt(att, scratch.q[wg], L::template keys<Cols>(in, block));
    warpgroup::arrive_at(L::next_turn(wg), BOTH);
    warpgroup::mma_async_wait<0>();
    softmax<Later>(s, att, scratch, in, g, t, it, wg, block);
    free_queries(scratch, s, t, it, wg);  // after the softmax, which may run S again
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    rt<typename L::element, 16, Cols> p;
    copy(p, att);
    if (it == t.iters - 1) zero_tail(L::v_of(in), t, wg);
    warpgroup::mma_AB(s.o, p, L::template values<Cols>(in, block));
    warpgroup::mma_async_wait<0>();
  }

  // trims: a tile this consumer sits out keeps its turn (a branch around the overlapped order's products would
  // serialize them).
  __device__ static void sit_out(int wg)
    requires(P.trims)
  {
    warpgroup::sync_with(TURN + wg, BOTH);
    warpgroup::arrive_at(L::next_turn(wg), BOTH);
  }

  // The last tile's P V, issued while its V is still held. The tile's rows past the sequence's end hold whatever
  // the page held (paged) or the next sequence's keys: masked (P = 0), but 0 * NaN is NaN in P V, so they are
  // zeroed first. Each consumer clears them before its own P V (both write the same zeros).
  __device__ static void drain(consumer_state& s, scratch_block&, const globals&, const task_t& t, int wg) {
    if constexpr (serial) return;  // every tile's P V is done in its own compute
    if (S::last_tile(s, t) == t.iters / SLOTS - 1) zero_tail(s.v_prev, t, wg);
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    if constexpr (P.half_last) {
      if (s.half) {
        warpgroup::mma_AB_leading(s.o, s.p, s.v_prev->template row_block<HALF>(0));
        wgmma::fence_operand(s.p);
        return;
      }
    }
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    wgmma::fence_operand(s.p);
  }
  __device__ static void zero_tail(const typename L::kv_tile* v, const task_t& t, int wg) {
    const int tail = t.lk - (t.first + t.iters / SLOTS - 1) * KV;
    if (tail < KV) warpgroup::zero_rows(v->ref(), tail, 1 + wg);
  }
};

}  // namespace tk::prefill
