// GEMM on kittens: 128 x 256 output tiles, a producer warpgroup streaming 64-wide k-slices of A and B
// through a TMA ring, two consumer warpgroups (64 rows each) accumulating with wgmma, and an epilogue in
// which each warpgroup stages its rows in 64 x 64 blocks and sends each with one TMA store while the
// producer already loads the next tile. Tiles are visited in a per-shape order by a persistent grid, launched
// chained (PDL), so that a GEMM after it on the stream sets up under its last tiles.
#include <cstdlib>
#include "../kittens/kittens.cuh"
#include "gemm.h"

using namespace kittens;

namespace {

constexpr int k_slice = 64;  // BK: the k-extent of one ring stage

// Stages: depth of the input ring. The epilogue uses what the ring leaves of shared memory: with 4 stages
// each warpgroup stages two 64 x 64 blocks at a time, with 3 its whole 64 x 256 at once.
// Cluster 2: two CTAs own vertically adjacent tiles of the same column block; each loads half of the
// shared B slice and multicasts it to both, cutting B's L2 traffic in half (slower here so far, not dispatched:
// docs/findings/gemm.md#gemm-cluster2).
// Chained: launched with programmatic dependent launch (see below).
// Lag: stages a consumer keeps its products in flight before freeing a stage (lcsf::options::release_lag).
template <typename T, bool BIsNK, int Stages, int Cluster, int Lag = 1>
struct gemm_kernel {
  static constexpr int BM = 128, BN = 256, BK = k_slice, consumers = 2, stages = Stages;
  // Chained to the stream's previous kernel, and the next may start setting up once this grid's loads are all
  // sent: back-to-back GEMMs overlap one's launch and prologue with the other's last tiles (lcsf.cuh).
  static constexpr lcsf::options pipeline{
      .release_lag = Lag, .chain = lcsf::launch_chain::chained_early_next, .cluster = Cluster};
  static constexpr int pieces = BN / 64, batch = Stages >= 4 ? 2 : 4;
  using a_tile = st<T, BM, BK>;
  using b_tile = std::conditional_t<BIsNK, st<T, BN, BK>, st<T, BK, BN>>;
  using b_part = std::conditional_t<BIsNK, st<T, BN / Cluster, BK>, st<T, BK, BN / Cluster>>;  // one CTA's share
  using c_block = st<T, 64, 64>;  // one consumer's 64 rows of a 64-column block: its warps' 16-row pieces stacked

  struct globals {
    gl<T, 1, 1, RUNTIME, RUNTIME, a_tile> a;
    gl<T, 1, 1, RUNTIME, RUNTIME, b_tile, b_part> b;
    gl<T, 1, 1, RUNTIME, RUNTIME, c_block> c;
    int tiles_m, tiles_n, k_iters;
    grouped_raster order;  // over (tiles_m / Cluster) x tiles_n
  };
  struct input_block { a_tile a; b_tile b; };
  struct scratch_block { c_block c[consumers][batch]; };
  struct consumer_state { rt_fl<16, BN> acc; };

  struct task_t { int m, n, iters, rank; };

  // Tasks are cluster-sized stacks of row blocks; rank r of the cluster takes row block r of the stack.
  __device__ static int task_count(const globals& g) { return ceil_div(g.tiles_m, Cluster) * g.tiles_n; }
  __device__ static task_t task(const globals& g, int id, int rank) {
    const tile_xy t = g.order(id);
    return {t.row * Cluster + rank, t.col, g.k_iters, rank};
  }

  __device__ static void load(input_block& in, const globals& g, const task_t& t, int k, semaphore& full) {
    expect_bytes(full, tma::bytes<a_tile>() + tma::bytes<b_tile>());
    tma::load_async(in.a, g.a, {.row = t.m * BM, .col = k * BK}, full);
    if constexpr (Cluster == 1) {
      if constexpr (BIsNK) tma::load_async(in.b, g.b, {.row = t.n * BN, .col = k * BK}, full);
      else tma::load_async(in.b, g.b, {.row = k * BK, .col = t.n * BN}, full);
    } else {
      constexpr uint16_t everyone = (1u << Cluster) - 1;
      constexpr int share = BN / Cluster;
      if constexpr (BIsNK)
        tma::load_async_multicast(in.b.template row_block<share>(t.rank), g.b,
                                  {.row = t.n * BN + t.rank * share, .col = k * BK}, full, everyone);
      else
        tma::load_async_multicast(in.b.template col_block<share>(t.rank), g.b,
                                  {.row = k * BK, .col = t.n * BN + t.rank * share}, full, everyone);
    }
  }

  __device__ static void compute(consumer_state& s, input_block& in, scratch_block&, const globals&, const task_t&, int k,
                                int wg) {
    const auto a = in.a.template row_block<64>(wg);
    if constexpr (BIsNK) {
      if (k == 0) warpgroup::mm_ABt(s.acc, a, in.b);
      else warpgroup::mma_ABt(s.acc, a, in.b);
    } else {
      if (k == 0) warpgroup::mm_AB(s.acc, a, in.b);
      else warpgroup::mma_AB(s.acc, a, in.b);
    }
  }

  // Epilogue: the warpgroup's 64 x 256 accumulator goes out in 64 x 64 blocks, `batch` at a time: each warp
  // writes its 16 rows of them, then one thread sends each block with one TMA store (4 stores a warpgroup and
  // tile, not 16 of 16 rows), while the producer already loads the next tile.
  __device__ static void finish(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t, int wg) {
    const int row = t.m * BM + wg * 64;
    if (row >= g.c.rows()) return;  // this warpgroup's rows are all past M
    auto& blocks = scratch.c[wg];
#pragma unroll
    for (int first = 0; first < pieces; first += batch) {
      if (warpgroup::thread() == 0) tma::store_wait_read<0>();  // earlier stores are done reading the blocks
      warpgroup::sync(1 + wg);
#pragma unroll
      for (int p = 0; p < batch; p++)
        warp::store(blocks[p].template row_block<16>(warpgroup::warp()), col_block<64>(s.acc, first + p));
      fence_async_shared();
      warpgroup::sync(1 + wg);
      if (warpgroup::thread() == 0) {
#pragma unroll
        for (int p = 0; p < batch; p++) {
          const int col = t.n * BN + (first + p) * 64;
          if (col < g.c.cols()) tma::store_async(g.c, blocks[p], {.row = row, .col = col});
        }
        tma::store_commit_group();
      }
    }
  }
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// The launch plan a shape gets (tuned on the H200 with scripts/tune_gemm.py; TK_GEMM_STAGES, TK_GEMM_LAG and
// TK_GEMM_GROUP_ROWS override it for sweeps):
// - short K (a tile's k-slices all fit in a 4-stage ring): 4 stages, so the producer loads the next tile whole
//   during the epilogue, and tiles in row-major order: A and B sit in L2 in any order and the output is nearly
//   all the traffic, so each round of tiles writes whole row panels of it.
// - longer K: 3 stages, whose shared memory leaves each warpgroup room to stage its whole 64 x 256 output at once
//   (one store wait a tile, not two), in 16-row groups for A and B's reuse in L2.
// docs/findings/gemm.md#gemm-plan has the measurements.
struct launch_plan {
  int stages, lag, group_rows;
};

launch_plan plan_for(int k_iters) {
  static const int stages = env_int("TK_GEMM_STAGES", 0), lag = env_int("TK_GEMM_LAG", -1),
                   group_rows = env_int("TK_GEMM_GROUP_ROWS", 0);
  const bool short_k = k_iters <= 4;
  return {
      .stages = stages == 3 || stages == 4 ? stages : short_k ? 4 : 3,
      .lag = lag == 0 || lag == 1 ? lag : 1,
      .group_rows = group_rows > 0 ? group_rows : short_k ? 1 : 16,
  };
}

template <typename T, bool BIsNK, int Stages, int Cluster, int Lag>
void run(const tk::gemm_problem& p, int group_rows, int num_sms, cudaStream_t stream) {
  using K = gemm_kernel<T, BIsNK, Stages, Cluster, Lag>;
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
      .order = {},
  };
  g.order = grouped_raster(ceil_div(g.tiles_m, Cluster), g.tiles_n, group_rows);
  // Balanced grid: the fewest CTAs that still take the tiles in as many rounds as one CTA per SM would, so
  // that every CTA runs the same number of tiles (4096^3: 512 tiles in 4 rounds on 128 CTAs, not 116 CTAs
  // running 4 and 16 running 3) and each round covers whole tile groups of the L2 order.
  const int tasks = ceil_div(g.tiles_m, Cluster) * g.tiles_n, slots = std::max(1, num_sms / Cluster);
  const int rounds = ceil_div(tasks, slots);
  lcsf::launch<K>(g, ceil_div(tasks, rounds) * Cluster, stream);
}

template <typename T, bool BIsNK>
void run_planned(const tk::gemm_problem& p, int num_sms, cudaStream_t stream) {
  const launch_plan plan = plan_for(ceil_div(int(p.k), k_slice));
  if (plan.stages == 3) {
    if (plan.lag == 0) run<T, BIsNK, 3, 1, 0>(p, plan.group_rows, num_sms, stream);
    else run<T, BIsNK, 3, 1, 1>(p, plan.group_rows, num_sms, stream);
  } else {
    if (plan.lag == 0) run<T, BIsNK, 4, 1, 0>(p, plan.group_rows, num_sms, stream);
    else run<T, BIsNK, 4, 1, 1>(p, plan.group_rows, num_sms, stream);
  }
}

}  // namespace

namespace tk {

void gemm(const gemm_problem& p, int num_sms, cudaStream_t stream) {
  if (p.type == dtype::bf16) {
    if (p.b_is_nk) run_planned<bf16, true>(p, num_sms, stream);
    else run_planned<bf16, false>(p, num_sms, stream);
  } else {
    if (p.b_is_nk) run_planned<half, true>(p, num_sms, stream);
    else run_planned<half, false>(p, num_sms, stream);
  }
}

}  // namespace tk
