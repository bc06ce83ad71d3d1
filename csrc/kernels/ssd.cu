// Mamba-2 SSD on kittens: the chunked scan (prefill, dense or varlen) and the one-token state update.
//
// Scan. A task is (sequence, group, pair of 64-wide head-dim blocks of that group's heads); each of the two
// consumer warpgroups owns one block (head h, columns p0..p0+63) and walks the sequence in 64-token chunks
// from its start, carrying its slice of the state S [64 x dstate] in fp32 registers. Per chunk, with
// a_t = dt_t A and dA the within-chunk cumulative sum of a (log2 units):
//   att   = C B^T                             masked to j <= i, scaled by 2^(dA_i - dA_j) dt_j   (tensor cores)
//   y     = 2^dA_i (C S^T) + att x             S in x's type from shared memory, att from registers
//   S     = 2^dA_last S + (x^T scaled by 2^(dA_last - dA_j) dt_j) B
//   y     = (y + D x) * silu(z)                stored by TMA (whole chunks) or row by row (a ragged tail)
// The producer streams C, B (shared by both consumers: same group) and the two x blocks through a TMA ring;
// dt is read by the consumers one chunk ahead. At dstate 256 (`split`, below) a task is one head-dim block instead:
// both consumers work on it, each holding half of S's columns, and one x block is streamed. The result does not depend on the chunk length (it is exact
// arithmetic regrouped), so every chunk_size runs as 64-token chunks; chunks never straddle sequences.
#include <cub/block/block_radix_sort.cuh>
#include "../kittens/kittens.cuh"
#include "ssd.h"

using namespace kittens;

namespace {

constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

// softplus(v) = ln(1 + e^v) as ex2 and lg2 on the special-function unit, v > 20 passed through (as mamba_ssm
// does). Absolute error about 2e-7 (lg2.approx's, times ln 2; where e^v < 2^-24 the sum rounds to 1 and the
// result to 0): far below what a bf16 output resolves, at two MUFU ops where log1pf is a ~20-instruction
// polynomial on the scan's dt path, which each chunk's state update waits for.
__device__ __forceinline__ float softplus(float v) {
  return v <= 20.f ? fast_log2(1.f + fast_exp2(v * LOG2E)) * LN2 : v;
}

// Dynamic: a ragged batch, whose tasks differ in length: CTAs claim them (lcsf::task_walk::claimed). A fixed batch
// keeps the stride order: there the claims only add an atomic round trip per task (docs/findings/ssd.md#ssd-dynamic).
template <typename T, int N, bool Dynamic>
struct ssd_scan_kernel {
  // split (dstate 256, Falcon-H1): both consumers work on one head-dim block, consumer c on state columns
  // [c NC, (c + 1) NC) (one consumer's whole S would take 128 registers a thread and spilled): C B^T and C S^T are
  // then sums over the two halves, which consumer 1 hands to consumer 0 through shared memory each chunk
  // (exchange); consumer 0 finishes the chunk (masks, P x, output), each updates its own half of S.
  static constexpr bool split = N > 128;
  static constexpr int L = 64, P = 64, consumers = 2, NC = split ? N / 2 : N, stages = N == 64 ? 4 : N == 128 ? 3 : 2;
  static constexpr int bc_parts = split ? 2 : 1, x_parts = split ? 1 : consumers;
  static constexpr lcsf::options pipeline{
      .release_lag = 0, .walk = Dynamic ? lcsf::task_walk::claimed : lcsf::task_walk::strided};
  using bc_tile = st<T, L, NC>;      // C or B of the chunk (split: one half of the state columns)
  using x_tile = st<T, L, P>;
  using y_piece = st<T, 16, P>;      // one warp's rows of a chunk's output, on its way out
  using state_tile = st<T, P, NC>;   // S in x's type: the B operand of C S^T
  using x_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, RUNTIME, x_tile>;   // (batch, head, token, p)
  using y_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, RUNTIME, y_piece>;
  using z_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, RUNTIME>;
  using bc_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, N, bc_tile>;        // (batch, group, token, n)
  using states_gl = gl<float, RUNTIME, RUNTIME, RUNTIME, N>;         // (seq, head, p, n)

  struct globals {
    x_gl x;
    y_gl y;
    z_gl z;
    bc_gl B, C;
    states_gl init, final_states;
    const float *dt, *A, *dt_bias, *D;
    long dt_strides[3], D_strides[2];
    const int* cu_seqlens;
    const int* order;  // varlen: sequences longest first (null: as given)
    int* task_counter;  // lcsf::task_walk::claimed
    long seqlen;
    int num_seqs, groups, heads_per_group, pblocks, units, pairs;
    bool has_z, has_init, has_final, softplus;
    float dt_min, dt_max;
  };
  struct input_block {
    bc_tile C[bc_parts], B[bc_parts];
    x_tile x[x_parts];
  };
  // split: consumer 1's partial C B^T and C S^T, each thread's fragment registers at [register][thread] (both
  // consumers' fragments have the same layout, so consumer 0's thread t adds what consumer 1's thread t left).
  struct exchange_buffer {
    float v[(16 * L + 16 * P) / WARP_THREADS][WARPGROUP_THREADS];  // att's registers, then y's
  };
  struct no_exchange {};
  struct scratch_block {
    state_tile S[consumers];
    y_piece y[split ? 1 : consumers][WARPGROUP_WARPS];
    [[no_unique_address]] std::conditional_t<split, exchange_buffer, no_exchange> exchange;
    // Per token j of the chunk, each warp keeping its own copy (no cross-warp barrier): dA_j; g_j =
    // log2(dt_j) - dA_j, so the decay mask's 2^(dA_i - dA_j) dt_j is 2^(dA_i + g_j); and the state update's
    // weight 2^(dA_last - dA_j) dt_j = 2^(dA_last + g_j).
    float dA[consumers][WARPGROUP_WARPS][L];
    float g[consumers][WARPGROUP_WARPS][L];
    float w[consumers][WARPGROUP_WARPS][L];
    float D[consumers][P];  // this task's D for the consumer's head-dim columns
  };
  struct consumer_state {
    rt_fl<16, NC> S;  // rows 16w..16w+15 of this block's state (p), all of dstate (split: the consumer's half)
    float dt_raw[2];  // the next chunk's raw dt of tokens 2 lane, 2 lane + 1
  };
  struct task_t {
    int b, seq, start, len, iters, group, head[consumers], col[consumers];
    bool valid[consumers];
    // Consumer c's fields by select, not by a run-time index (which would put the arrays in local memory).
    __device__ int head_of(int c) const { return c ? head[1] : head[0]; }
    __device__ int col_of(int c) const { return c ? col[1] : col[0]; }
    __device__ bool valid_of(int c) const { return c ? valid[1] : valid[0]; }
  };

  __device__ static int task_count(const globals& g) { return g.num_seqs * g.groups * g.pairs; }
  __device__ static task_t task(const globals& g, int id, int) {
    task_t t;
    const int rank = id / (g.groups * g.pairs);  // longest first when ordered: the long chains start early
    t.seq = g.order ? g.order[rank] : rank;
    t.group = id / g.pairs % g.groups;
    const int pair = id % g.pairs;
    if (g.cu_seqlens) {
      t.b = 0;
      t.start = g.cu_seqlens[t.seq];
      t.len = g.cu_seqlens[t.seq + 1] - t.start;
    } else {
      t.b = t.seq;
      t.start = 0;
      t.len = int(g.seqlen);
    }
    t.iters = t.len > 0 ? ceil_div(t.len, L) : 0;
#pragma unroll
    for (int c = 0; c < consumers; c++) {
      const int unit = split ? pair : 2 * pair + c;  // split: both consumers on the pair's one unit
      t.valid[c] = unit < g.units;
      const int u = min(unit, g.units - 1);  // an idle consumer computes on a duplicate and stores nothing
      t.head[c] = t.group * g.heads_per_group + u / g.pblocks;
      t.col[c] = (u % g.pblocks) * P;
    }
    return t;
  }

  __device__ static void load(input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    expect_bytes(full, 2 * bc_parts * tma::bytes<bc_tile>() + x_parts * tma::bytes<x_tile>());
    const int row = t.start + it * L;
#pragma unroll
    for (int h = 0; h < bc_parts; h++) {
      tma::load_async(in.C[h], g.C, {.b = t.b, .d = t.group, .row = row, .col = h * NC}, full);
      tma::load_async(in.B[h], g.B, {.b = t.b, .d = t.group, .row = row, .col = h * NC}, full);
    }
#pragma unroll
    for (int c = 0; c < x_parts; c++)
      tma::load_async(in.x[c], g.x, {.b = t.b, .d = t.head[c], .row = row, .col = t.col[c]}, full);
  }
  // Consumer c's tiles: its half of C and B (split), and its block of x.
  __device__ static const bc_tile& C_of(const input_block& in, int c) { return in.C[split ? c : 0]; }
  __device__ static const bc_tile& B_of(const input_block& in, int c) { return in.B[split ? c : 0]; }
  __device__ static x_tile& x_of(input_block& in, int c) { return in.x[split ? 0 : c]; }

  // ---- dt and the decay ----------------------------------------------------------------------------
  __device__ static void fetch_dt(consumer_state& s, const globals& g, const task_t& t, int it, int c) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int tok = it * L + 2 * laneid() + e;
      s.dt_raw[e] = tok < t.len ? g.dt[t.b * g.dt_strides[0] + long(t.start + tok) * g.dt_strides[1] +
                                       long(t.head_of(c)) * g.dt_strides[2]]
                                : 0.f;
    }
  }
  // dt' = clamp(softplus?(dt + bias)) (0 past the sequence end) and dA = cumsum(dt' A) * log2(e) of chunk
  // `it`, then the per-token factors of the chunk's products (see scratch_block) into this warp's arrays;
  // prefetches the next chunk's dt. Returns dA of the chunk's last token.
  __device__ static float chunk_decay(consumer_state& s, const globals& g, const task_t& t, int it, int c,
                                      float* dA, float* gj, float* wj) {
    const int head = t.head_of(c);
    const float A = g.A[head] * LOG2E, bias = g.dt_bias ? g.dt_bias[head] : 0.f;
    float d[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
      float v = s.dt_raw[e] + bias;
      if (g.softplus) v = softplus(v);
      v = fminf(fmaxf(v, g.dt_min), g.dt_max);
      d[e] = it * L + 2 * laneid() + e < t.len ? v : 0.f;
    }
    fetch_dt(s, g, t, it + 1, c);
    const float a0 = d[0] * A, pair = a0 + d[1] * A;
    float incl = pair;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float n = __shfl_up_sync(0xffffffffu, incl, o);
      if (laneid() >= o) incl += n;
    }
    const float last = __shfl_sync(0xffffffffu, incl, 31);
    const float da[2] = {incl - pair + a0, incl};
    __syncwarp();  // the previous chunk's readers are done
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const float ge = fast_log2(d[e]) - da[e];  // -inf where dt' = 0: both factors are then exactly 0
      dA[2 * laneid() + e] = da[e];
      gj[2 * laneid() + e] = ge;
      wj[2 * laneid() + e] = fast_exp2(last + ge);
    }
    __syncwarp();
    return last;
  }

  // ---- a task's state ----------------------------------------------------------------------------------
  __device__ static void initial_state(consumer_state& s, const globals& g, const task_t& t, int c) {
    if (g.has_init)
      warpgroup::load(s.S, g.init, {.b = t.seq, .d = t.head_of(c), .row = t.col_of(c), .col = split ? c * NC : 0});
    else zero(s.S);
  }

  __device__ static void compute_first(consumer_state& s, input_block& in, scratch_block& sc, const globals& g,
                                       const task_t& t, int c) {
    initial_state(s, g, t, c);
    warpgroup::store(sc.S[c].ref(), s.S);
    fence_async_shared();
    if (g.D)  // read by every chunk's epilogue: once per task
      for (int j = warpgroup::thread(); j < P; j += WARPGROUP_THREADS)
        sc.D[c][j] = g.D[t.head_of(c) * g.D_strides[0] + (t.col_of(c) + j) * g.D_strides[1]];
    fetch_dt(s, g, t, 0, c);
    warpgroup::sync(1 + c);
    compute(s, in, sc, g, t, 0, c);
  }

  __device__ static void compute(consumer_state& s, input_block& in, scratch_block& sc, const globals& g,
                                 const task_t& t, int it, int c) {
    const int w = warpgroup::warp();
    float* dA = sc.dA[c][w];  // written by chunk_decay below, then read by the masks and the state update
    float* gj = sc.g[c][w];
    float* wj = sc.w[c][w];

    rt_fl<16, L> att;
    rt_fl<16, P> y;
    warpgroup::mm_ABt(att, C_of(in, c), B_of(in, c));
    warpgroup::mm_ABt(y, C_of(in, c), sc.S[c]);
    // While those run (they read neither dt nor the decay): the chunk's decay factors, and S's decay.
    const float dA_last = chunk_decay(s, g, t, it, c, dA, gj, wj);
    mul(s.S, s.S, fast_exp2(dA_last));
    // The state update next, ahead of the masked products: it is the chain from chunk to chunk (the next
    // chunk's C S^T waits for it), and it needs only x, B and the decay. Its A operand x^T, token j weighted
    // by 2^(dA_last - dA_j) dt_j; the products in registers do not read the shared copy of S it replaces.
    rt<T, 16, L> xt;
    warpgroup::load_t(xt, x_of(in, c).ref());
    map_at(xt, xt, 0, 0, [=](float v, int, int j) { return v * wj[j]; });
    warpgroup::mma_AB(s.S, xt, B_of(in, c));
    warpgroup::mma_async_wait<1>();  // att and C S^T are done; the state update may still run
    if constexpr (split) {
      exchange(att, y, sc, c);
      if (c == 1) {  // its half of C B^T and C S^T handed over: only its state update is left
        warpgroup::mma_async_wait<0>();
        warpgroup::store(sc.S[c].ref(), s.S);
        fence_async_shared();
        warpgroup::sync(1 + c);
        return;
      }
    }

    const int row0 = 16 * w;
    map_at(att, att, row0, 0,
           [=](float v, int i, int j) { return j <= i ? v * fast_exp2(dA[i] + gj[j]) : 0.f; });
    map_at(y, y, row0, 0, [=](float v, int i, int) { return v * fast_exp2(dA[i]); });
    rt<T, 16, L> p;
    copy(p, att);
    warpgroup::mma_AB(y, p, x_of(in, c));
    warpgroup::mma_async_wait<1>();  // the state update is done (groups retire in order)

    warpgroup::store(sc.S[c].ref(), s.S);  // this chunk's C S^T has finished reading the old one
    warpgroup::mma_async_wait<0>();
    epilogue(y, in, sc, g, t, it, c);  // its proxy fence covers the S store too (one fence a chunk, not two)
    warpgroup::sync(1 + c);  // the new S is complete before the next chunk's products read it
  }

  // split: consumer 1 leaves its partial att and C S^T, consumer 0 adds them to its own. Two named barriers of
  // both consumers (ids 3, 4; 1 and 2 are the consumers' own), each met once a chunk by both: at XC consumer 0
  // has read the previous chunk's partials (so consumer 1 may overwrite them), at XR this chunk's are written.
  static constexpr int XC = 3, XR = 4, BOTH = 2 * WARPGROUP_THREADS;
  __device__ static void exchange(rt_fl<16, L>& att, rt_fl<16, P>& y, scratch_block& sc, int c) {
    const int me = warpgroup::thread();
    warpgroup::sync_with(XC, BOTH);
    if (c == 1) {
      int r = 0;
      for_each_element<rt_fl<16, L>>([&](int i, int j, int k, int e) { sc.exchange.v[r++][me] = elem(att.data[i][j][k], e); });
      for_each_element<rt_fl<16, P>>([&](int i, int j, int k, int e) { sc.exchange.v[r++][me] = elem(y.data[i][j][k], e); });
    }
    warpgroup::sync_with(XR, BOTH);
    if (c == 0) {
      int r = 0;
      for_each_element<rt_fl<16, L>>([&](int i, int j, int k, int e) { elem(att.data[i][j][k], e) += sc.exchange.v[r++][me]; });
      for_each_element<rt_fl<16, P>>([&](int i, int j, int k, int e) { elem(y.data[i][j][k], e) += sc.exchange.v[r++][me]; });
    }
  }

  // Ends with a proxy fence on every path: the caller's shared-memory writes before it (the new S) are then
  // visible to the async proxy (the next chunk's wgmma) as well as this chunk's output piece (its TMA store).
  __device__ static void epilogue(rt_fl<16, P>& y, input_block& in, scratch_block& sc, const globals& g,
                                  const task_t& t, int it, int c) {
    const int w = warpgroup::warp(), head = t.head_of(c), row = t.start + it * L;
    if (g.D) {  // + D x: this warp's rows of x by ldmatrix, D from the task's copy in shared memory
      rt<T, 16, P> xr;
      warpgroup::load(xr, x_of(in, c).ref());
      const float* Dc = sc.D[c];
      map_at(y, y, xr, 0, 0, [=](float v, float xv, int, int j) { return v + Dc[j] * xv; });
    }
    if (g.has_z) {  // * silu(z), z element by element (an optional path)
      const T* zp = g.z.at({.b = t.b, .d = head, .row = row, .col = t.col_of(c)});
      const long zs = g.z.strides[2], rows = g.seqlen - row;
      map_at(y, y, 16 * w, 0, [=](float v, int i, int j) {
        const float zv = i < rows ? convert<float>(zp[i * zs + j]) : 0.f;
        return v * zv / (1.f + __expf(-zv));
      });
    }
    if (!t.valid_of(c)) {
      fence_async_shared();
      return;
    }
    if (t.len - it * L >= L) {  // a whole chunk: each warp sends its 16 rows through one TMA store
      const auto piece = sc.y[split ? 0 : c][w].ref();
      if (laneid() == 0) tma::store_wait_read<0>();
      __syncwarp();
      warp::store(piece, y);
      fence_async_shared();
      __syncwarp();
      if (laneid() == 0) {
        tma::store_async(g.y, piece, {.b = t.b, .d = head, .row = row + 16 * w, .col = t.col_of(c)});
        tma::store_commit_group();
      }
    } else {  // the sequence ends inside this chunk: its rows only (the next sequence's rows follow)
      warpgroup::store(g.y, y, {.b = t.b, .d = head, .row = row, .col = t.col_of(c)}, long(t.start) + t.len);
      fence_async_shared();
    }
  }

  __device__ static void finish(consumer_state& s, scratch_block&, const globals& g, const task_t& t, int c) {
    if (laneid() == 0) tma::store_wait_read<0>();  // this warp's output pieces are free again
    if (!t.valid_of(c) || !g.has_final) return;
    if (t.iters == 0) initial_state(s, g, t, c);  // an empty sequence keeps its initial state
    warpgroup::store(g.final_states, s.S,
                     {.b = t.seq, .d = t.head_of(c), .row = t.col_of(c), .col = split ? c * NC : 0});
  }
};

// Varlen scans: sequence indices by length, longest first (stable), so that the dynamic task feed starts the
// long chains of chunks early and fills the gaps with short ones, instead of leaving a long sequence to the end.
constexpr int ORDER_THREADS = 256, ORDER_ITEMS = 8, ORDER_CAPACITY = ORDER_THREADS * ORDER_ITEMS;

__global__ void __launch_bounds__(ORDER_THREADS) order_sequences(const int* cu_seqlens, int num_seqs, int* order) {
  using sort_t = cub::BlockRadixSort<int, ORDER_THREADS, ORDER_ITEMS, int>;
  __shared__ typename sort_t::TempStorage storage;
  int len[ORDER_ITEMS], seq[ORDER_ITEMS];
#pragma unroll
  for (int i = 0; i < ORDER_ITEMS; i++) {  // blocked arrangement: thread t holds items t * ITEMS + i
    const int s = threadIdx.x * ORDER_ITEMS + i;
    seq[i] = s;
    len[i] = s < num_seqs ? cu_seqlens[s + 1] - cu_seqlens[s] : -1;  // past the end: sorts last
  }
  sort_t(storage).SortDescending(len, seq);
#pragma unroll
  for (int i = 0; i < ORDER_ITEMS; i++) {
    const int r = threadIdx.x * ORDER_ITEMS + i;
    if (r < num_seqs) order[r] = seq[i];
  }
}

template <typename T, int N, bool Dynamic>
void run_scan(const tk::ssd_scan_problem& p, int num_sms, cudaStream_t stream) {
  using K = ssd_scan_kernel<T, N, Dynamic>;
  static_assert(lcsf::shared_bytes<K> <= 227 * 1024 - 1024, "the scan's tiles pass a Hopper CTA's shared memory");
  auto ptr = [](const void* x) { return static_cast<T*>(const_cast<void*>(x)); };
  typename K::globals g{};
  const long b = p.batch, h = p.heads, l = p.seqlen, hd = p.headdim, gr = p.groups;
  g.x = {ptr(p.x), {b, h, l, hd}, {p.x_strides[0], p.x_strides[2], p.x_strides[1], 1}};
  g.y = {ptr(p.out), {b, h, l, hd}, {p.out_strides[0], p.out_strides[2], p.out_strides[1], 1}};
  if (p.z) g.z = {ptr(p.z), {b, h, l, hd}, {p.z_strides[0], p.z_strides[2], p.z_strides[1], 1}};
  g.B = {ptr(p.B), {b, gr, l, N}, {p.B_strides[0], p.B_strides[2], p.B_strides[1], 1}};
  g.C = {ptr(p.C), {b, gr, l, N}, {p.C_strides[0], p.C_strides[2], p.C_strides[1], 1}};
  const long seqs = p.num_seqs;
  if (p.initial_states)
    g.init = {const_cast<float*>(p.initial_states), {seqs, h, hd, N},
              {p.init_strides[0], p.init_strides[1], p.init_strides[2], 1}};
  if (p.final_states)
    g.final_states = {p.final_states, {seqs, h, hd, N}, {p.final_strides[0], p.final_strides[1], p.final_strides[2], 1}};
  g.dt = p.dt;
  g.A = p.A;
  g.dt_bias = p.dt_bias;
  g.D = p.D;
  for (int i = 0; i < 3; i++) g.dt_strides[i] = p.dt_strides[i];
  g.D_strides[0] = p.D_strides[0];
  g.D_strides[1] = p.D_strides[1];
  g.cu_seqlens = p.cu_seqlens;
  if constexpr (Dynamic) {  // claimed tasks, longest sequence first where sortable
    g.task_counter = p.workspace;
    TK_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, sizeof(int), stream));
    if (p.num_seqs <= ORDER_CAPACITY) {
      g.order = p.workspace + 1;
      order_sequences<<<1, ORDER_THREADS, 0, stream>>>(p.cu_seqlens, p.num_seqs, p.workspace + 1);
      TK_LAUNCH_CHECK();
    }
  }
  g.seqlen = p.seqlen;
  g.num_seqs = p.num_seqs;
  g.groups = p.groups;
  g.heads_per_group = p.heads / p.groups;
  g.pblocks = p.headdim / K::P;
  g.units = g.heads_per_group * g.pblocks;
  g.pairs = K::split ? g.units : ceil_div(g.units, K::consumers);  // split: a task is one unit
  g.has_z = p.z != nullptr;
  g.has_init = p.initial_states != nullptr;
  g.has_final = p.final_states != nullptr;
  g.softplus = p.dt_softplus;
  g.dt_min = p.dt_min;
  g.dt_max = p.dt_max;
  const long tasks = long(p.num_seqs) * p.groups * g.pairs;
  lcsf::launch<K>(g, int(std::min<long>(tasks, num_sms)), stream);
}

template <typename T>
void scan_dtype(const tk::ssd_scan_problem& p, int num_sms, cudaStream_t stream) {
  const bool ragged = tk::ssd_scan_ragged(p.cu_seqlens != nullptr, p.num_seqs);
  if (p.dstate == 64) ragged ? run_scan<T, 64, true>(p, num_sms, stream) : run_scan<T, 64, false>(p, num_sms, stream);
  else if (p.dstate == 128) ragged ? run_scan<T, 128, true>(p, num_sms, stream) : run_scan<T, 128, false>(p, num_sms, stream);
  else ragged ? run_scan<T, 256, true>(p, num_sms, stream) : run_scan<T, 256, false>(p, num_sms, stream);
}

// ---- decode: one token per batch row ----------------------------------------------------------------
// The update streams each row's state once (read, scale, add, write back): at a serving batch that is hundreds
// of MB a layer, so the kernel is a bandwidth problem. A CTA takes (batch row, head, a block of head-dim rows);
// a thread holds its rows' state slices as 16-byte vectors, all loaded before any is used (the old one-lane-per-
// element loop waited a full memory round trip per element: 0.14 TB/s at batch 128, docs/findings/ssd.md#ssd-update-vec).
// Row r's y is the sum over its TPR threads (a shuffle within the row's lanes).
template <typename S>
struct state_vec {  // 16 bytes of state, moved by one 128-bit access (asm: ptxas splits a uint4 store otherwise)
  static constexpr int n = 16 / sizeof(S);
  __device__ static void unpack(const uint32_t* w, float (&v)[n]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
      if constexpr (std::is_same_v<S, float>) {
        v[i] = __uint_as_float(w[i]);
      } else {
        packed<S> raw;
        memcpy(&raw, &w[i], sizeof raw);
        const float2 pair = convert<float2>(raw);
        v[2 * i] = pair.x, v[2 * i + 1] = pair.y;
      }
    }
  }
  __device__ static void pack(const float (&v)[n], uint32_t* w) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
      if constexpr (std::is_same_v<S, float>) {
        w[i] = __float_as_uint(v[i]);
      } else {
        const packed<S> pair = convert<packed<S>>(make_float2(v[2 * i], v[2 * i + 1]));
        memcpy(&w[i], &pair, sizeof pair);
      }
    }
  }
  __device__ static void load(const S* src, float (&v)[n]) {
    uint32_t w[4];
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(src));
    unpack(w, v);
  }
  __device__ static void store(S* dst, const float (&v)[n]) {
    uint32_t w[4];
    pack(v, w);
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
  }
};

template <typename T, typename S, int N>
struct ssd_update_vec {
  static constexpr int threads = 128;
  static constexpr int VEC = state_vec<S>::n;
  static constexpr int TPR = N / VEC < WARP_THREADS ? N / VEC : WARP_THREADS;  // threads a row
  static constexpr int EPT = N / TPR;                                          // a thread's elements a row
  static constexpr int NV = EPT / VEC;
  static constexpr int RPP = threads / TPR;  // rows a pass of the CTA
  static constexpr int RPT = 4;              // rows a thread (their loads all in flight together)
  static constexpr int rows = RPP * RPT;     // rows a CTA
  static_assert(N % (VEC * TPR) == 0 && WARP_THREADS % TPR == 0);
};

template <typename T, typename S, int N>
__global__ void __launch_bounds__(128, 4) ssd_update_vec_kernel(const tk::ssd_update_problem p) {
  using K = ssd_update_vec<T, S, N>;
  const int b = blockIdx.x, h = blockIdx.y;
  const long slot = p.state_indices ? p.state_indices[b] : b;
  if (p.state_indices && slot == p.pad_slot_id) return;
  if (slot < 0 || slot >= p.num_states) return;  // a garbage slot id touches nothing
  const int grp = h / (p.heads / p.groups);
  const int sub = threadIdx.x % K::TPR, n0 = sub * K::EPT;
  const int row0 = blockIdx.z * K::rows + threadIdx.x / K::TPR;
  S* const state = static_cast<S*>(p.state) + slot * p.state_strides[0] + h * p.state_strides[1];
  const T* const Bv = static_cast<const T*>(p.B) + b * p.B_strides[0] + grp * p.B_strides[1] + n0;
  const T* const Cv = static_cast<const T*>(p.C) + b * p.C_strides[0] + grp * p.C_strides[1] + n0;
  // Everything a thread reads, issued before any of it is used: RPT x NV state vectors, the rows' scalars, B, C.
  float s[K::RPT][K::EPT], dt[K::RPT], xv[K::RPT], dskip[K::RPT], zv[K::RPT], bn[K::EPT], cn[K::EPT];
#pragma unroll
  for (int i = 0; i < K::RPT; i++) {
    const int row = row0 + i * K::RPP;
    if (row < p.headdim) {
#pragma unroll
      for (int v = 0; v < K::NV; v++) {
        float part[K::VEC];
        state_vec<S>::load(state + row * p.state_strides[2] + n0 + v * K::VEC, part);
#pragma unroll
        for (int e = 0; e < K::VEC; e++) s[i][v * K::VEC + e] = part[e];
      }
    }
    const int r = row < p.headdim ? row : 0;
    dt[i] = p.dt[b * p.dt_strides[0] + h * p.dt_strides[1] + r * p.dt_strides[2]] +
            (p.dt_bias ? p.dt_bias[h * p.dt_bias_strides[0] + r * p.dt_bias_strides[1]] : 0.f);
    xv[i] = convert<float>(static_cast<const T*>(p.x)[b * p.x_strides[0] + h * p.x_strides[1] + r]);
    dskip[i] = p.D ? p.D[h * p.D_strides[0] + r * p.D_strides[1]] : 0.f;
    zv[i] = p.z ? convert<float>(static_cast<const T*>(p.z)[b * p.z_strides[0] + h * p.z_strides[1] + r]) : 0.f;
  }
#pragma unroll
  for (int e = 0; e < K::EPT; e++) bn[e] = convert<float>(Bv[e]), cn[e] = convert<float>(Cv[e]);
  const bool a_per_row = p.A_strides[2] == 0;  // vLLM's A [nheads] expanded: one exp a row
#pragma unroll
  for (int i = 0; i < K::RPT; i++) {
    const int row = row0 + i * K::RPP;
    const bool live = row < p.headdim;
    const float d = p.dt_softplus ? softplus(dt[i]) : dt[i];
    const float* A = p.A + h * p.A_strides[0] + (live ? row : 0) * p.A_strides[1] + n0 * p.A_strides[2];
    const float da_row = a_per_row ? __expf(d * A[0]) : 0.f;
    const float dx = d * xv[i];
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < K::EPT; e++) {
      const float da = a_per_row ? da_row : __expf(d * A[e * p.A_strides[2]]);
      s[i][e] = s[i][e] * da + dx * bn[e];
      acc += s[i][e] * cn[e];
    }
    if (live) {
#pragma unroll
      for (int v = 0; v < K::NV; v++) {
        float part[K::VEC];
#pragma unroll
        for (int e = 0; e < K::VEC; e++) part[e] = s[i][v * K::VEC + e];
        state_vec<S>::store(state + row * p.state_strides[2] + n0 + v * K::VEC, part);
      }
    }
#pragma unroll
    for (int m = K::TPR / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (live && sub == 0) {
      acc += xv[i] * dskip[i];
      if (p.z) acc *= zv[i] / (1.f + __expf(-zv[i]));
      static_cast<T*>(p.out)[b * p.out_strides[0] + h * p.out_strides[1] + row] = convert<T>(acc);
    }
  }
}

// vLLM's form (dt, A, D, dt_bias constant over a head's rows, no z; the state in x's dtype) where a (slot, head)
// block is contiguous: the CTA copies the block into shared memory with one bulk copy, updates it there and copies
// it back, so what is in flight is bounded by shared memory (8-32 KB a CTA), not by registers.
template <typename T, int N, int P>
struct ssd_update_bulk {
  static constexpr int threads = 128;
  static constexpr int VEC = 16 / sizeof(T);
  static constexpr int TPR = N / VEC < WARP_THREADS ? N / VEC : WARP_THREADS;
  static constexpr int EPT = N / TPR, NV = EPT / VEC;
  static constexpr int RPP = threads / TPR;
  static constexpr int passes = P / RPP;
  static constexpr uint32_t bytes = uint32_t(P) * N * sizeof(T);
  static_assert(P % RPP == 0 && bytes % 16 == 0 && bytes <= 48 * 1024);
};

template <typename T, int N, int P>
__global__ void __launch_bounds__(128, 8) ssd_update_bulk_kernel(const tk::ssd_update_problem p) {
  using K = ssd_update_bulk<T, N, P>;
  extern __shared__ __align__(128) unsigned char block_bytes[];
  __shared__ semaphore landed;
  const int b = blockIdx.x, h = blockIdx.y;
  const long slot = p.state_indices ? p.state_indices[b] : b;
  if (p.state_indices && slot == p.pad_slot_id) return;
  if (slot < 0 || slot >= p.num_states) return;  // a garbage slot id touches nothing
  T* const state = static_cast<T*>(p.state) + slot * p.state_strides[0] + h * p.state_strides[1];
  T* const block = reinterpret_cast<T*>(block_bytes);
  if (threadIdx.x == 0) {
    init_semaphore(landed, 1);
    fence_semaphore_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    expect_bytes(landed, K::bytes);
    tma::load_bytes_async(block, state, K::bytes, landed);
  }
  // While the block lands: the head's dt, exp(dt A) and D, the rows' x, B and C.
  const int grp = h / (p.heads / p.groups);
  const int sub = threadIdx.x % K::TPR, n0 = sub * K::EPT, r0 = threadIdx.x / K::TPR;
  float dt = p.dt[b * p.dt_strides[0] + h * p.dt_strides[1]] + (p.dt_bias ? p.dt_bias[h * p.dt_bias_strides[0]] : 0.f);
  if (p.dt_softplus) dt = softplus(dt);
  const float da = __expf(dt * p.A[h * p.A_strides[0]]);
  const float dskip = p.D ? p.D[h * p.D_strides[0]] : 0.f;
  const T* const x = static_cast<const T*>(p.x) + b * p.x_strides[0] + h * p.x_strides[1];
  const T* const Bv = static_cast<const T*>(p.B) + b * p.B_strides[0] + grp * p.B_strides[1] + n0;
  const T* const Cv = static_cast<const T*>(p.C) + b * p.C_strides[0] + grp * p.C_strides[1] + n0;
  float xv[K::passes], dbn[K::EPT], cn[K::EPT];
#pragma unroll
  for (int i = 0; i < K::passes; i++) xv[i] = convert<float>(x[r0 + i * K::RPP]);
#pragma unroll
  for (int e = 0; e < K::EPT; e++) dbn[e] = dt * convert<float>(Bv[e]), cn[e] = convert<float>(Cv[e]);
  wait(landed, 0);
#pragma unroll
  for (int i = 0; i < K::passes; i++) {
    const int row = r0 + i * K::RPP;
    float acc = 0.f;
#pragma unroll
    for (int v = 0; v < K::NV; v++) {
      const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(block + row * N + n0 + v * K::VEC));
      uint4 raw = detail::ld_shared_16B<T>(at);
      uint32_t* const w = reinterpret_cast<uint32_t*>(&raw);
      float part[K::VEC];
      state_vec<T>::unpack(w, part);
#pragma unroll
      for (int e = 0; e < K::VEC; e++) {
        part[e] = part[e] * da + xv[i] * dbn[v * K::VEC + e];
        acc += part[e] * cn[v * K::VEC + e];
      }
      state_vec<T>::pack(part, w);
      detail::st_shared_16B(at, raw);
    }
#pragma unroll
    for (int m = K::TPR / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (sub == 0)
      static_cast<T*>(p.out)[b * p.out_strides[0] + h * p.out_strides[1] + row] = convert<T>(acc + xv[i] * dskip);
  }
  fence_async_shared();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::store_bytes_async(state, block, K::bytes);
    tma::store_commit_group();
    tma::store_wait_read<0>();  // the block stays until the copy has read it
  }
}

// Any other shape (dstate outside 64 / 128 / 256, a state view whose rows are not 16-byte aligned): a CTA per
// (batch row, head); warp w walks head-dim rows w, w + 4, ...; lanes split dstate.
template <typename T, typename S>
__global__ void __launch_bounds__(128) ssd_update_kernel(const tk::ssd_update_problem p) {
  const int b = blockIdx.x, h = blockIdx.y;
  const long slot = p.state_indices ? p.state_indices[b] : b;
  if (p.state_indices && slot == p.pad_slot_id) return;
  if (slot < 0 || slot >= p.num_states) return;
  const int grp = h / (p.heads / p.groups);
  S* state = static_cast<S*>(p.state) + slot * p.state_strides[0] + h * p.state_strides[1];
  const T* x = static_cast<const T*>(p.x) + b * p.x_strides[0] + h * p.x_strides[1];
  const T* Bv = static_cast<const T*>(p.B) + b * p.B_strides[0] + grp * p.B_strides[1];
  const T* Cv = static_cast<const T*>(p.C) + b * p.C_strides[0] + grp * p.C_strides[1];
  const T* z = p.z ? static_cast<const T*>(p.z) + b * p.z_strides[0] + h * p.z_strides[1] : nullptr;
  T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1];
  for (int row = warpid(); row < p.headdim; row += 4) {
    float dt = p.dt[b * p.dt_strides[0] + h * p.dt_strides[1] + row * p.dt_strides[2]];
    if (p.dt_bias) dt += p.dt_bias[h * p.dt_bias_strides[0] + row * p.dt_bias_strides[1]];
    if (p.dt_softplus) dt = softplus(dt);
    const float xv = convert<float>(x[row]);
    const float* A = p.A + h * p.A_strides[0] + row * p.A_strides[1];
    S* srow = state + row * p.state_strides[2];
    float acc = 0.f;
    for (int n = laneid(); n < p.dstate; n += WARP_THREADS) {
      const float s = convert<float>(srow[n]) * __expf(dt * A[n * p.A_strides[2]]) + dt * xv * convert<float>(Bv[n]);
      srow[n] = convert<S>(s);
      acc += s * convert<float>(Cv[n]);
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (laneid() == 0) {
      if (p.D) acc += xv * p.D[h * p.D_strides[0] + row * p.D_strides[1]];
      if (z) {
        const float zv = convert<float>(z[row]);
        acc *= zv / (1.f + __expf(-zv));
      }
      out[row] = convert<T>(acc);
    }
  }
}

template <typename S>
bool rows_aligned(const tk::ssd_update_problem& p) {  // every state row starts on 16 bytes
  constexpr long v = 16 / sizeof(S);
  return reinterpret_cast<uintptr_t>(p.state) % 16 == 0 && p.state_strides[0] % v == 0 &&
         p.state_strides[1] % v == 0 && p.state_strides[2] % v == 0;
}

template <typename T, typename S, int N>
void launch_update_vec(const tk::ssd_update_problem& p, cudaStream_t stream) {
  using K = ssd_update_vec<T, S, N>;
  const dim3 grid(p.batch, p.heads, ceil_div(p.headdim, K::rows));
  ssd_update_vec_kernel<T, S, N><<<grid, K::threads, 0, stream>>>(p);
}

// vLLM's form: dt [batch, heads, headdim] and A [heads, headdim, dstate] expanded from per-head values, D and dt_bias
// [heads, headdim] likewise (or absent), no z.
inline bool per_head(const tk::ssd_update_problem& p) {
  return p.dt_strides[2] == 0 && p.A_strides[1] == 0 && p.A_strides[2] == 0 && (!p.D || p.D_strides[1] == 0) &&
         (!p.dt_bias || p.dt_bias_strides[1] == 0) && !p.z;
}

template <typename T, int N, int P>
void launch_update_bulk(const tk::ssd_update_problem& p, cudaStream_t stream) {
  using K = ssd_update_bulk<T, N, P>;
  ssd_update_bulk_kernel<T, N, P><<<dim3(p.batch, p.heads), K::threads, K::bytes, stream>>>(p);
}

// The bulk kernel's shapes: a (slot, head) block of at most 48 KB, rows contiguous and 16-byte aligned.
template <typename T>
bool launch_bulk(const tk::ssd_update_problem& p, cudaStream_t stream) {
  if (!per_head(p) || !rows_aligned<T>(p) || p.state_strides[2] != p.dstate) return false;
  if (p.headdim == 64 && p.dstate == 64) launch_update_bulk<T, 64, 64>(p, stream);
  else if (p.headdim == 64 && p.dstate == 128) launch_update_bulk<T, 128, 64>(p, stream);
  else if (p.headdim == 64 && p.dstate == 256) launch_update_bulk<T, 256, 64>(p, stream);
  else if (p.headdim == 128 && p.dstate == 64) launch_update_bulk<T, 64, 128>(p, stream);
  else if (p.headdim == 128 && p.dstate == 128) launch_update_bulk<T, 128, 128>(p, stream);
  else return false;
  return true;
}

template <typename T, typename S>
void update_state(const tk::ssd_update_problem& p, cudaStream_t stream) {
  if constexpr (std::is_same_v<S, T>) {
    if (launch_bulk<T>(p, stream)) {
      TK_LAUNCH_CHECK();
      return;
    }
  }
  const bool vec = rows_aligned<S>(p);
  if (vec && p.dstate == 64) launch_update_vec<T, S, 64>(p, stream);
  else if (vec && p.dstate == 128) launch_update_vec<T, S, 128>(p, stream);
  else if (vec && p.dstate == 256) launch_update_vec<T, S, 256>(p, stream);
  else ssd_update_kernel<T, S><<<dim3(p.batch, p.heads), 128, 0, stream>>>(p);
  TK_LAUNCH_CHECK();
}

template <typename T>
void update_dtype(const tk::ssd_update_problem& p, cudaStream_t stream) {
  if (p.state_fp32) update_state<T, float>(p, stream);
  else update_state<T, T>(p, stream);
}

}  // namespace

namespace tk {

void ssd_scan(const ssd_scan_problem& p, int num_sms, cudaStream_t stream) {
  if (p.num_seqs <= 0 || p.heads <= 0) return;
  if (p.type == dtype::bf16) scan_dtype<bf16>(p, num_sms, stream);
  else scan_dtype<half>(p, num_sms, stream);
}

void ssd_update(const ssd_update_problem& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads <= 0) return;
  if (p.type == dtype::bf16) update_dtype<bf16>(p, stream);
  else update_dtype<half>(p, stream);
}

}  // namespace tk
