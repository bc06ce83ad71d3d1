// Based linear attention (arXiv 2402.18668) on kittens: chunked causal prefill and the recurrent decode step.
//
// The kernel of Based is the 2nd-order Taylor expansion of exp: w(q, k) = 1 + s + s^2 / 2 with s = scale q.k.
// It factors through phi(x) = [1, x, x (x) x], w = phi(q) . diag(1, 1, 1/2) phi(k), so the state after token
// j is the moments of the keys against the values: zeroth sum v, first sum k (x) v, second sum k (x) k (x) v,
// and the normaliser sum_j w(q, k_j) is the same moments against a value of ones (column Dv of the state).
//
// Prefill: a task is (batch, head, 64 value columns); the two consumer warpgroups take 32 columns each and
// walk the sequence in 64-token chunks that the producer streams in with TMA. Per chunk:
//   o  = q_s phi-lo . M_lo + (q_s (x) q_s / 2) . M_2      the earlier chunks (bf16 copies of the moments)
//   o += tril(1 + s + s^2 / 2) . v                       the chunk itself, s = scale q k^T
//   M_lo += [k^T; 1] v,  M_2 += (k (x) k)^T v            fp32 moments, accumulated by wgmma in registers
// The normaliser's moments (count, sum k, sum k k^T: 273 floats) are kept in fp32 on the CUDA cores.
#include <array>
#include <cfloat>
#include <utility>
#include "../kittens/kittens.cuh"
#include "based.h"

using namespace kittens;

namespace {

constexpr int CHUNK = 64, DK = 16, FEAT2 = DK * DK, COLS = 32, SLICE = 64;

template <typename T>
struct based_prefill {
  static constexpr int consumers = SLICE / COLS, stages = 4;
  static constexpr lcsf::options pipeline{.release_lag = 0};
  static constexpr int BLOCKS = 5;  // 64-feature blocks: k (x) k in 0..3, then [k; 1; 0] (first, zeroth)
  using qk_tile = st<T, CHUNK, DK>;
  using v_tile = st<T, CHUNK, COLS>;
  using qk_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, DK, qk_tile>;        // (batch, head, token, 16)
  using v_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, RUNTIME, v_tile>;     // (batch, head, token, Dv)
  using state_gl = gl<float>;                                         // (batch, head, feature, Dv + 1)

  struct globals {
    qk_gl q, k;
    v_gl v, o;
    state_gl init0, init1, init2, fin0, fin1, fin2;
    int has_init, has_final, batch, heads, slices, seqlen, dv, use_norm;
    float scale, eps;
  };
  struct input_block {
    qk_tile q, k;
    v_tile v[consumers];
  };
  // Feature maps are the same for both consumers: each builds half of them, for both.
  struct scratch_block {
    st_bf<CHUNK, 64 * BLOCKS> qf;         // tokens x features: q_s (x) q_s / 2, then [q_s | 1 | 0]
    st<T, 64 * BLOCKS, CHUNK> kf;         // features x tokens: (k (x) k)^T, then [k^T; 1; 0]
    st_bf<64 * BLOCKS, COLS> m[consumers];  // bf16 copies of each consumer's moments (the read-out's B)
    st<T, CHUNK, COLS> out[consumers];    // the normalised output on its way to TMA
    float z[DK + FEAT2];                  // the normaliser's moments sum k, sum k k^T (fp32)
  };
  using col16 = rt_fl<16, 16>::per_col;
  using row16 = rt_fl<16, 16>::per_row;
  struct consumer_state {
    rt_fl<16, COLS> m[BLOCKS];  // fp32 moments of this consumer's columns, feature block by block
    row16 g[2];                 // normaliser sum k_a k_b for the blocks this consumer builds (a = 4m + warp)
    row16 z1;                   // normaliser sum k_b (consumer 0)
    float z0;                   // tokens so far, plus the initial state's count
  };
  struct task_t {
    int b, h, slice, iters;
  };
  static constexpr int BOTH = 3;  // named barrier of both consumers (the shared feature maps)

  __device__ static void sync_both() { warpgroup::sync_with(BOTH, consumers * WARPGROUP_THREADS); }

  __device__ static int task_count(const globals& g) { return g.batch * g.heads * g.slices; }
  __device__ static task_t task(const globals& g, int id, int) {
    const int bh = id / g.slices;
    return {bh / g.heads, bh % g.heads, id % g.slices, ceil_div(g.seqlen, CHUNK)};
  }

  __device__ static void load(input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    expect_bytes(full, 2 * tma::bytes<qk_tile>() + consumers * tma::bytes<v_tile>());
    const coord at{.b = t.b, .d = t.h, .row = it * CHUNK};
    tma::load_async(in.q, g.q, at, full);
    tma::load_async(in.k, g.k, at, full);
#pragma unroll
    for (int c = 0; c < consumers; c++)
      tma::load_async(in.v[c], g.v, {.b = t.b, .d = t.h, .row = it * CHUNK, .col = t.slice * SLICE + c * COLS}, full);
  }

  // The per-column vector of a 16-wide tile read from fp32 shared memory (src[col]).
  __device__ static void load_cols(col16& v, const float* src) {
    const int c = 2 * (laneid() & 3);
    const float2 lo = *reinterpret_cast<const float2*>(src + c), hi = *reinterpret_cast<const float2*>(src + c + 8);
    v.data[0][0] = lo.x, v.data[0][1] = lo.y, v.data[0][2] = hi.x, v.data[0][3] = hi.y;
  }

  // The moments become the next chunk's operands: bf16 copies for wgmma, the normaliser for the CUDA cores.
  __device__ static void publish(consumer_state& s, scratch_block& sc, int wg) {
    const int w = warpgroup::warp();
#pragma unroll
    for (int m = 0; m < BLOCKS; m++) warpgroup::store(sc.m[wg].template row_block<64>(m), s.m[m]);
    if ((laneid() & 3) == 0) {
      const int b = laneid() / 4;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        if (wg == 0 && w == 0) sc.z[b + 8 * h] = s.z1.data[0][h];
#pragma unroll
        for (int i = 0; i < 2; i++) sc.z[DK + (4 * (2 * wg + i) + w) * DK + b + 8 * h] = s.g[i].data[0][h];
      }
    }
    if (warpgroup::thread() == 0) tma::store_wait_read<0>();  // the last output tile has left sc.out
    fence_async_shared();
    sync_both();
  }

  __device__ static void start_task(consumer_state& s, scratch_block& sc, const globals& g, const task_t& t, int wg) {
    const int w = warpgroup::warp(), col0 = t.slice * SLICE + wg * COLS;
    sync_both();  // the other consumer's finish has read the previous task's normaliser from sc.z
#pragma unroll
    for (int m = 0; m < BLOCKS; m++) zero(s.m[m]);
    zero(s.g[0]);
    zero(s.g[1]);
    zero(s.z1);
    s.z0 = 0.f;
    if (g.has_init) {
#pragma unroll
      for (int m = 0; m < 4; m++) warpgroup::load(s.m[m], g.init2, {.b = t.b, .d = t.h, .row = 64 * m, .col = col0});
      if (w == 0) warp::load(s.m[4], g.init1, {.b = t.b, .d = t.h, .col = col0});
      if (w == 1) warp::load(s.m[4], g.init0, {.b = t.b, .d = t.h, .col = col0});  // one row: the rest reads 0
      const int b = laneid() / 4;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        s.z1.data[0][h] = *g.init1.at({t.b, t.h, b + 8 * h, g.dv});
#pragma unroll
        for (int i = 0; i < 2; i++)
          s.g[i].data[0][h] = *g.init2.at({t.b, t.h, (4 * (2 * wg + i) + w) * DK + b + 8 * h, g.dv});
      }
      s.z0 = *g.init0.at({t.b, t.h, 0, g.dv});
    }
    publish(s, sc, wg);
  }

  __device__ static void chunk(consumer_state& s, input_block& in, scratch_block& sc, const globals& g,
                               const task_t& t, int it, int wg) {
    const int w = warpgroup::warp();
    // ---- query features (this consumer's half) and the normaliser's read-out of the earlier chunks ---
    row16 z_inter;
    {
      rt<T, 16, 16> q;
      warpgroup::load(q, in.q.ref());
      rt_fl<16, 16> qs, part, blk;
      col16 zc;
      mul(qs, q, g.scale);
      load_cols(zc, sc.z);
      mul_col(part, qs, zc);  // q_s . sum k
#pragma unroll
      for (int m = 0; m < 4; m++) {
        rt_bf<16, 64> q2;  // features (a, b) = (4m + j, b) of q_s (x) q_s / 2
#pragma unroll
        for (int j = 0; j < 4; j++) {
          row16 qa;
          col_of(qa, qs, 4 * m + j);
          map_row(blk, qs, qa, [](float x, float y) { return 0.5f * x * y; });
          set_col_block<16>(q2, j, blk);
          load_cols(zc, sc.z + DK + (4 * m + j) * DK);
          mul_col(blk, blk, zc);  // . sum k k^T, this lane's columns
          add(part, part, blk);
        }
        if (m / 2 == wg) warpgroup::store(sc.qf.template col_block<64>(m), q2);
      }
      if (wg == 0) {
        rt_bf<16, 64> lo;  // [q_s | 1 | 0]: reads out the first and zeroth moments
        fill(lo, 1.f);
        mask(lo, lo, 0, 0, [](int, int c) { return c == DK; }, 0.f);
        set_col_block<16>(lo, 0, qs);
        warpgroup::store(sc.qf.template col_block<64>(4), lo);
      }
      row_sum(z_inter, part);
    }
    fence_async_shared();
    sync_both();

    // ---- o = phi(q) . moments + tril(1 + s + s^2 / 2) . v -----------------------------------------------
    rt_fl<16, COLS> o;
    {
      rt_fl<16, CHUNK> att;
      warpgroup::mm_ABt(att, in.q, in.k);
      warpgroup::mm_AB(o, sc.qf, sc.m[wg]);
      warpgroup::mma_async_wait<1>();  // the scores are in
      const float scale = g.scale;
      map(att, att, [scale](float x) { const float sx = x * scale; return 1.f + sx + 0.5f * sx * sx; });
      tril(att, att, 16 * w, 0, 0, 0.f);
      row16 z;
      row_sum(z, att);
      rt<T, 16, CHUNK> p;
      copy(p, att);
      warpgroup::mma_AB(o, p, in.v[wg]);
      warpgroup::mma_async_wait<0>();
      wgmma::fence_operand(p);
      if (g.use_norm) {
        const float z0 = s.z0, eps = g.eps;
        map(z, z, z_inter, [z0, eps](float intra, float inter) { return intra + inter + z0 + eps; });
        div_row(o, o, z);
      }
    }
    warpgroup::store(sc.out[wg].ref(), o);
    fence_async_shared();
    warpgroup::sync(1 + wg);
    if (warpgroup::thread() == 0) {
      tma::store_async(g.o, sc.out[wg], {.b = t.b, .d = t.h, .row = it * CHUNK, .col = t.slice * SLICE + wg * COLS});
      tma::store_commit_group();
    }

    // ---- key features (this consumer's half), then fold the chunk into the moments ------------------
    {
      rt<T, 64, 16, col_l> kc;
      warp::load(kc, in.k.ref());
      const rt<T, 16, 64> kt = transpose(kc);  // k^T: features x tokens (every warp holds all of it)
#pragma unroll
      for (int i = 0; i < 2; i++) {
        const int m = 2 * wg + i;
        rt_fl<16, 64>::per_col ka;
        rt_fl<16, 64> prod;
        row16 gsum;
        row_of(ka, kt, 4 * m + w);
        mul_col(prod, kt, ka);  // rows (4m + w, b): k_a k_b over the chunk's tokens
        row_sum(gsum, prod);
        add(s.g[i], s.g[i], gsum);
        warpgroup::store(sc.kf.template row_block<64>(m), prod);
      }
      if (wg == 0) {
        row16 ksum;
        row_sum(ksum, kt);
        add(s.z1, s.z1, ksum);
        rt<T, 16, 64> lo;
        if (w == 0) {
          copy(lo, kt);
        } else {
          fill(lo, w == 1 ? 1.f : 0.f);
          mask(lo, lo, 0, 0, [](int r, int) { return r == 0; }, 0.f);
        }
        warpgroup::store(sc.kf.template row_block<64>(4), lo);
      }
    }
    s.z0 += float(min(CHUNK, g.seqlen - it * CHUNK));
    fence_async_shared();
    sync_both();
#pragma unroll
    for (int m = 0; m < BLOCKS; m++) warpgroup::mma_AB(s.m[m], sc.kf.template row_block<64>(m), in.v[wg]);
    warpgroup::mma_async_wait<0>();
    publish(s, sc, wg);
  }

  __device__ static void compute_first(consumer_state& s, input_block& in, scratch_block& sc, const globals& g,
                                       const task_t& t, int wg) {
    start_task(s, sc, g, t, wg);
    chunk(s, in, sc, g, t, 0, wg);
  }
  __device__ static void compute(consumer_state& s, input_block& in, scratch_block& sc, const globals& g,
                                 const task_t& t, int it, int wg) {
    chunk(s, in, sc, g, t, it, wg);
  }

  __device__ static void finish(consumer_state& s, scratch_block& sc, const globals& g, const task_t& t, int wg) {
    if (!g.has_final) return;
    const int w = warpgroup::warp(), col0 = t.slice * SLICE + wg * COLS;
#pragma unroll
    for (int m = 0; m < 4; m++) warpgroup::store(g.fin2, s.m[m], {.b = t.b, .d = t.h, .row = 64 * m, .col = col0});
    if (w == 0) warp::store(g.fin1, s.m[4], {.b = t.b, .d = t.h, .col = col0});
    if (w == 1) warp::store(g.fin0, s.m[4], {.b = t.b, .d = t.h, .col = col0});  // row 0 only
    if (t.slice == 0 && wg == 0) {  // the normaliser column, from its published copy
      for (int f = warpgroup::thread(); f < DK + FEAT2; f += WARPGROUP_THREADS) {
        if (f < DK) *g.fin1.at({t.b, t.h, f, g.dv}) = sc.z[f];
        else *g.fin2.at({t.b, t.h, f - DK, g.dv}) = sc.z[f];
      }
      if (warpgroup::thread() == 0) *g.fin0.at({t.b, t.h, 0, g.dv}) = s.z0;
    }
  }
};

// ---- decode: one token against the fp32 state, read and written once ---------------------------------
// A block per (batch, head) of W * j threads (W = Dv + 1 state columns). The first and second moments of one
// (batch, head) are contiguous runs of rows x W floats, walked as one run of DK + FEAT2 rows (feature row
// 1 + r for run row r); thread t streams the 4-float groups at 4t + i * 4Wj, a stride that is a whole number
// of rows, so its four columns never change: it keeps their output partial sums in registers and adds them
// to the block's column sums once at the end. The state does not depend on the token, so the first round of
// loads goes out before the features are built, and each round's loads go out before the previous round is
// updated and stored (the two never touch the same floats, so in-place updates stay correct).
constexpr int FEATURES = 1 + DK + FEAT2;

template <typename T>
__global__ void __launch_bounds__(256, 4) based_step_kernel(const tk::based_step_problem p) {
  extern __shared__ float smem[];
  const int W = p.head_dim_v + 1;
  float* phi_k = smem;              // [FEATURES]
  float* phi_q = phi_k + FEATURES;  // [FEATURES], the 1/2 of the second order folded in
  float* va = phi_q + FEATURES;     // [W]: v and the normaliser's 1
  float* colsum = va + W;           // [W]: phi(q) . new state, per column
  __shared__ float qs[DK], kk[DK];
  const int b = blockIdx.x / p.heads, h = blockIdx.x % p.heads, tid = threadIdx.x;
  const long bh = long(b) * p.heads + h;

  // The state run: rows [0, DK) in the first moment, [DK, DK + FEAT2) in the second.
  const float* in1 = p.state_in.first + bh * DK * W;
  const float* in2 = p.state_in.second + bh * FEAT2 * W;
  float* out1 = p.state_out.first + bh * DK * W;
  float* out2 = p.state_out.second + bh * FEAT2 * W;
  const int split = DK * W, total = (DK + FEAT2) * W;  // split is a multiple of 4: no group straddles it
  const bool vec = ((reinterpret_cast<uintptr_t>(in1) | reinterpret_cast<uintptr_t>(in2) |
                     reinterpret_cast<uintptr_t>(out1) | reinterpret_cast<uintptr_t>(out2)) & 15) == 0;
  const int stride = 4 * blockDim.x, rows_per_step = stride / W;  // blockDim.x is a multiple of W
  const int col0 = (4 * tid) % W, row0 = (4 * tid) / W;
  constexpr int INFLIGHT = 4;  // groups per round; two rounds are in flight while one is updated
  auto load = [&](float4 (&x)[INFLIGHT], int e0) {
#pragma unroll
    for (int i = 0; i < INFLIGHT; i++) {
      const int e = e0 + i * stride;
      if (e >= total) continue;
      const float* src = e < split ? in1 + e : in2 + (e - split);
      x[i] = vec ? *reinterpret_cast<const float4*>(src) : make_float4(src[0], src[1], src[2], src[3]);
    }
  };
  float4 cur[INFLIGHT], next[INFLIGHT];
  load(cur, 4 * tid);

  const T* q = static_cast<const T*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + h * p.k_strides[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + h * p.v_strides[1];
  if (tid < DK) qs[tid] = convert<float>(q[tid]) * p.scale, kk[tid] = convert<float>(k[tid]);
  for (int c = tid; c < W; c += blockDim.x) va[c] = c < p.head_dim_v ? convert<float>(v[c]) : 1.f, colsum[c] = 0.f;
  __syncthreads();
  for (int f = tid; f < FEATURES; f += blockDim.x) {
    if (f == 0) phi_k[f] = 1.f, phi_q[f] = 1.f;
    else if (f <= DK) phi_k[f] = kk[f - 1], phi_q[f] = qs[f - 1];
    else {
      const int a = (f - 1 - DK) / DK, c = (f - 1 - DK) % DK;
      phi_k[f] = kk[a] * kk[c], phi_q[f] = 0.5f * qs[a] * qs[c];
    }
  }
  __syncthreads();

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const int round = INFLIGHT * stride;
  for (int e0 = 4 * tid, r0 = row0; e0 < total; e0 += round, r0 += INFLIGHT * rows_per_step) {
    load(next, e0 + round);  // before this round's stores: disjoint floats
#pragma unroll
    for (int i = 0; i < INFLIGHT; i++) {
      const int e = e0 + i * stride;
      if (e >= total) continue;
      float y[4] = {cur[i].x, cur[i].y, cur[i].z, cur[i].w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const int wrap = col0 + j >= W, c = col0 + j - (wrap ? W : 0), f = 1 + r0 + i * rows_per_step + wrap;
        y[j] += phi_k[f] * va[c];
        acc[j] += phi_q[f] * y[j];
      }
      float* dst = e < split ? out1 + e : out2 + (e - split);
      if (vec) *reinterpret_cast<float4*>(dst) = make_float4(y[0], y[1], y[2], y[3]);
      else dst[0] = y[0], dst[1] = y[1], dst[2] = y[2], dst[3] = y[3];
    }
#pragma unroll
    for (int i = 0; i < INFLIGHT; i++) cur[i] = next[i];
  }
  float zero = 0.f;
  if (tid < W) {  // the zeroth moment: one row
    zero = p.state_in.zeroth[bh * W + tid] + va[tid];
    p.state_out.zeroth[bh * W + tid] = zero;
  }
#pragma unroll
  for (int j = 0; j < 4; j++) atomicAdd(&colsum[col0 + j - (col0 + j >= W ? W : 0)], acc[j]);
  if (tid < W) atomicAdd(&colsum[tid], zero);
  __syncthreads();
  if (tid < p.head_dim_v) {
    const float num = colsum[tid], den = colsum[p.head_dim_v];
    T* o = static_cast<T*>(p.o) + b * p.o_strides[0] + h * p.o_strides[1];
    o[tid] = convert<T>(p.use_norm ? num / (den + p.eps) : num);
  }
}

template <typename T>
void run_prefill(const tk::based_problem& p, int num_sms, cudaStream_t stream) {
  using K = based_prefill<T>;
  auto ptr = [](const void* x) { return static_cast<T*>(const_cast<void*>(x)); };
  const long B = p.batch, H = p.heads, N = p.seqlen, Dv = p.head_dim_v, W = Dv + 1;
  auto view = [&](const long* s, long cols) {  // (batch, head, token, cols) of [B, N, H, cols]
    return std::make_pair(std::array<long, 4>{B, H, N, cols}, std::array<long, 4>{s[0], s[2], s[1], 1});
  };
  typename K::globals g{};
  {
    auto [sz, st] = view(p.q_strides, DK);
    g.q = {ptr(p.q), sz, st};
  }
  {
    auto [sz, st] = view(p.k_strides, DK);
    g.k = {ptr(p.k), sz, st};
  }
  {
    auto [sz, st] = view(p.v_strides, Dv);
    g.v = {ptr(p.v), sz, st};
  }
  {
    auto [sz, st] = view(p.o_strides, Dv);
    g.o = {ptr(p.o), sz, st};
  }
  auto state = [&](float* x, long rows) { return typename K::state_gl(x, {B, H, rows, W}); };
  g.has_init = p.initial.zeroth != nullptr;
  g.has_final = p.final.zeroth != nullptr;
  g.init0 = state(p.initial.zeroth, 1), g.init1 = state(p.initial.first, DK), g.init2 = state(p.initial.second, FEAT2);
  g.fin0 = state(p.final.zeroth, 1), g.fin1 = state(p.final.first, DK), g.fin2 = state(p.final.second, FEAT2);
  g.batch = p.batch;
  g.heads = p.heads;
  g.slices = p.head_dim_v / SLICE;
  g.seqlen = p.seqlen;
  g.dv = p.head_dim_v;
  g.use_norm = p.use_norm;
  g.scale = p.scale;
  g.eps = p.eps;
  const long tasks = B * H * g.slices;
  lcsf::launch<K>(g, int(std::min<long>(tasks, num_sms)), stream);
}

template <typename T>
void run_step(const tk::based_step_problem& p, cudaStream_t stream) {
  const int W = p.head_dim_v + 1, threads = W * std::max(1, 256 / W);  // a multiple of W (see the kernel)
  const size_t smem = sizeof(float) * (2 * FEATURES + 2 * W);
  based_step_kernel<T><<<p.batch * p.heads, threads, smem, stream>>>(p);
  TK_LAUNCH_CHECK();
}

}  // namespace

namespace tk {

void based_prefill(const based_problem& p, int num_sms, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads <= 0 || p.seqlen <= 0) return;
  if (p.type == dtype::bf16) run_prefill<bf16>(p, num_sms, stream);
  else run_prefill<half>(p, num_sms, stream);
}

void based_step(const based_step_problem& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads <= 0) return;
  if (p.type == dtype::bf16) run_step<bf16>(p, stream);
  else run_step<half>(p, stream);
}

}  // namespace tk
