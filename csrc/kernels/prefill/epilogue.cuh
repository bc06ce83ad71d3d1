// Prefill's epilogue: o / l and the LSE of each row, out through shared memory and a TMA store (a sequence's
// ragged last rows element by element).
#pragma once
#include "scheduler.cuh"

namespace tk::prefill {

template <typename L>
struct prefill_epilogue {
  static constexpr policy P = L::config;
  static constexpr int QROWS = L::QROWS;
  using globals = typename L::globals;
  using task_t = typename L::task_t;
  using scratch_block = typename L::scratch_block;
  using consumer_state = typename L::consumer_state;

  __device__ static void finish(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t, int wg) {
    wgmma::fence_operand(s.p);
    const int r0 = t.row0 + wg * QROWS;
    if (t.valid && r0 >= 0 && r0 < t.lq) write_output(s, scratch, g, t, wg, r0);  // no visible key: out 0, lse -inf
    L::reset_accumulators(s);
  }

  __device__ static void write_output(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t,
                                      int wg, int r0) {
    typename L::row_vec lse;
    tk::attn::finalize<tk::attn::finalize_math::approximate>(s.o, lse, s.m, s.l, L::scoring(g));
    if constexpr (P.sinks) {
      typename L::row_vec sink;
      fill(sink, g.sinks[t.h]);
      tk::attn::apply_sinks(s.o, lse, sink);
    }
    // lse: lanes 0, 4, ... hold rows g and g + 8 of each warp's 16
    if (laneid() % 4 == 0) {
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const int row = r0 + warpgroup::warp() * 16 + laneid() / 4 + 8 * half;
        if (row < t.lq) g.lse[t.h * g.lse_stride + t.q0 + row] = lse.data[0][half];
      }
    }
    if (r0 + QROWS <= t.lq) {  // a whole tile: through shared memory and one TMA store
      // The buffer's last store must have read it: with queries_ahead, the previous task's output from o; else a
      // task without keys (no compute_first, which waits) may follow one whose output store still reads q.
      typename L::q_tile* staging;
      if constexpr (P.queries_ahead) staging = &scratch.o[wg];
      else staging = &scratch.q[wg];
      if constexpr (P.warp_epilogue) {  // warp syncs only: the warp's rows, its own bulk-store group
        const auto rows = staging->template row_block<16>(warpgroup::warp());
        if (laneid() == 0) tma::store_wait_read<0>();
        __syncwarp();
        warp::store(rows, s.o);
        fence_async_shared();
        __syncwarp();
        if (laneid() == 0) {
          tma::store_async(g.o, rows, {.d = t.h, .row = t.q0 + r0 + 16 * warpgroup::warp()});
          tma::store_commit_group();
        }
        return;
      }
      if (P.queries_ahead || t.iters == 0) {
        if (warpgroup::thread() == 0) tma::store_wait_read<0>();
        warpgroup::sync(1 + wg);
      }
      warpgroup::store(staging->ref(), s.o);
      fence_async_shared();
      warpgroup::sync(1 + wg);
      if (warpgroup::thread() == 0) {
        tma::store_async(g.o, *staging, {.d = t.h, .row = t.q0 + r0});
        tma::store_commit_group();
      }
    } else {  // the sequence ends inside this tile: write its rows only
      warpgroup::store_each(g.o, s.o, {.d = t.h, .row = t.q0 + r0}, long(t.q0) + t.lq);  // see store_each
    }
  }
};

}  // namespace tk::prefill
