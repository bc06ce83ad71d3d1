// GEMM on kittens: 128 x 256 output tiles, a producer warpgroup streaming 64-wide k-slices of A and B
// through a 4-stage TMA ring, two consumer warpgroups (64 rows each) accumulating with wgmma, and an
// epilogue that writes bf16/fp16 through TMA stores in 64-column pieces while the producer already
// loads the next tile. Tiles are visited in grouped order by a persistent grid.
#include "../kittens/kittens.cuh"
#include "gemm.h"

using namespace kittens;

namespace {

template <typename T, bool BIsNK>
struct gemm_kernel {
  static constexpr int BM = 128, BN = 256, BK = 64, consumers = 2, stages = 4, group_rows = 16;
  using a_tile = st<T, BM, BK>;
  using b_tile = std::conditional_t<BIsNK, st<T, BN, BK>, st<T, BK, BN>>;
  using c_tile = st<T, 64, 64>;

  struct globals {
    gl<T, 1, 1, RUNTIME, RUNTIME, a_tile> a;
    gl<T, 1, 1, RUNTIME, RUNTIME, b_tile> b;
    gl<T, 1, 1, RUNTIME, RUNTIME, c_tile> c;
    int tiles_m, tiles_n, k_iters;
  };
  struct input_block { a_tile a; b_tile b; };
  struct scratch_block { c_tile c[consumers][2]; };  // double-buffered epilogue pieces per consumer
  struct consumer_state { rt_fl<16, BN> acc; };
  struct task_t { int m, n, iters; };

  __device__ static int task_count(const globals& g) { return g.tiles_m * g.tiles_n; }
  __device__ static task_t task(const globals& g, int id) {
    const tile_xy t = grouped_order(id, g.tiles_m, g.tiles_n, group_rows);
    return {t.row, t.col, g.k_iters};
  }

  __device__ static void load(input_block& in, const globals& g, const task_t& t, int k, semaphore& full) {
    expect_bytes(full, tma::bytes<a_tile>() + tma::bytes<b_tile>());
    tma::load_async(in.a, g.a, {.row = t.m * BM, .col = k * BK}, full);
    if constexpr (BIsNK) tma::load_async(in.b, g.b, {.row = t.n * BN, .col = k * BK}, full);
    else tma::load_async(in.b, g.b, {.row = k * BK, .col = t.n * BN}, full);
  }

  __device__ static void compute(consumer_state& s, input_block& in, const globals&, const task_t&, int k, int wg) {
    const auto a = in.a.template row_block<64>(wg);
    if constexpr (BIsNK) {
      if (k == 0) warpgroup::mm_ABt(s.acc, a, in.b);
      else warpgroup::mma_ABt(s.acc, a, in.b);
    } else {
      if (k == 0) warpgroup::mm_AB(s.acc, a, in.b);
      else warpgroup::mma_AB(s.acc, a, in.b);
    }
  }

  __device__ static void finish(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t, int wg) {
    const int barrier = 1 + wg;
    const int row = t.m * BM + wg * 64;
    if (row >= g.c.rows()) return;  // a ragged last tile: this consumer's rows are all past M
#pragma unroll
    for (int piece = 0; piece < BN / 64; piece++) {
      const int col = t.n * BN + piece * 64;
      if (col >= g.c.cols()) break;  // past N: nothing to write
      c_tile& out = scratch.c[wg][piece % 2];
      if (warpgroup::thread() == 0) tma::store_wait_read<1>();  // the store that last used `out` has read it
      warpgroup::sync(barrier);
      warpgroup::store(out.ref(), col_block<64>(s.acc, piece));
      fence_async_shared();
      warpgroup::sync(barrier);
      if (warpgroup::thread() == 0) {
        tma::store_async(g.c, out, {.row = row, .col = col});
        tma::store_commit_group();
      }
    }
  }
};

template <typename T, bool BIsNK>
void run(const tk::gemm_problem& p, int num_sms, cudaStream_t stream) {
  using K = gemm_kernel<T, BIsNK>;
  auto* a = static_cast<T*>(const_cast<void*>(p.a));
  auto* b = static_cast<T*>(const_cast<void*>(p.b));
  auto* c = static_cast<T*>(p.c);
  const long b_rows = BIsNK ? p.n : p.k, b_cols = BIsNK ? p.k : p.n;
  typename K::globals g{
      .a = {a, {1, 1, p.m, p.k}, {0, 0, p.lda, 1}},
      .b = {b, {1, 1, b_rows, b_cols}, {0, 0, p.ldb, 1}},
      .c = {c, {1, 1, p.m, p.n}, {0, 0, p.ldc, 1}},
      .tiles_m = ceil_div(int(p.m), K::BM),
      .tiles_n = ceil_div(int(p.n), K::BN),
      .k_iters = ceil_div(int(p.k), K::BK),
  };
  const int tasks = g.tiles_m * g.tiles_n;
  lcsf::launch<K>(g, std::min(tasks, num_sms), stream);
}

}  // namespace

namespace tk {

void gemm(const gemm_problem& p, int num_sms, cudaStream_t stream) {
  if (p.type == dtype::bf16) {
    if (p.b_is_nk) run<bf16, true>(p, num_sms, stream);
    else run<bf16, false>(p, num_sms, stream);
  } else {
    if (p.b_is_nk) run<half, true>(p, num_sms, stream);
    else run<half, false>(p, num_sms, stream);
  }
}

}  // namespace tk
