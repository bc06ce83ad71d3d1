// Primitive kernels for the fast test tier: each exercises one DSL building block end to end.
// Built as a plain shared library (no torch headers, seconds to compile) and driven through ctypes by
// tests/gpu/test_primitives.py. Every entry point returns a cudaError_t after synchronising.
#include "../kittens/kittens.cuh"

using namespace kittens;

namespace {

// ---- TMA: global -> shared -> registers -> shared -> global, for each swizzle width -------------
template <typename T, int R, int C, typename Layout>
struct roundtrip {
  using tile = st<T, R, C>;
  using view = gl<T, 1, 1, RUNTIME, RUNTIME, tile>;
  struct globals { view in, out; };
  struct smem_t { tile a, b; };
};

template <typename T, int R, int C, typename Layout>
__global__ void __launch_bounds__(128) roundtrip_kernel(const __grid_constant__ typename roundtrip<T, R, C, Layout>::globals g) {
  using P = roundtrip<T, R, C, Layout>;
  extern __shared__ uint8_t raw[];
  auto& s = *reinterpret_cast<typename P::smem_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  __shared__ semaphore loaded;
  if (threadIdx.x == 0) { init_semaphore(loaded, 1); fence_semaphore_init(); }
  __syncthreads();
  const coord at{.row = int(blockIdx.y) * R, .col = int(blockIdx.x) * C};
  if (threadIdx.x == 0) {
    expect_bytes(loaded, tma::bytes<typename P::tile>());
    tma::load_async(s.a, g.in, at, loaded);
  }
  wait(loaded, 0);
  rt<T, R / 4, C, Layout> r;
  warpgroup::load(r, s.a.ref());
  warpgroup::store(s.b.ref(), r);
  fence_async_shared();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::store_async(g.out, s.b, at);
    tma::store_commit_group();
    tma::store_wait<0>();
  }
}

template <typename T, int R, int C, typename Layout>
cudaError_t run_roundtrip(const void* in, void* out, int rows, int cols) {
  using P = roundtrip<T, R, C, Layout>;
  typename P::globals g{.in = {(T*)in, {1, 1, rows, cols}}, .out = {(T*)out, {1, 1, rows, cols}}};
  const int smem = sizeof(typename P::smem_t) + 1024;
  auto* fn = &roundtrip_kernel<T, R, C, Layout>;
  cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  fn<<<dim3(ceil_div(cols, C), ceil_div(rows, R)), 128, smem>>>(g);
  cudaError_t e = cudaGetLastError();
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

// ---- wgmma: D[64, N] = A[64, K] @ B with A in shared (64 x K, or K x 64 used transposed) or registers,
// B as K x N or N x K; Leading: D = A[:, :K/2] @ B[:K/2] from registers whose other columns hold NaN
// (copy_leading, then mma_AB_leading on B's first K/2 rows) -----------------------------------------------
template <int N, int K, bool ARegs, bool BIsNK, bool AIsKM = false, bool Leading = false>
struct mma_case {
  using a_tile = std::conditional_t<AIsKM, st_bf<K, 64>, st_bf<64, K>>;
  using b_tile = std::conditional_t<BIsNK, st_bf<N, K>, st_bf<K, N>>;
  struct globals {
    gl<bf16, 1, 1, RUNTIME, RUNTIME, a_tile> a;
    gl<bf16, 1, 1, RUNTIME, RUNTIME, b_tile> b;
    gl<float, 1, 1, RUNTIME, RUNTIME> d;
  };
  struct smem_t { a_tile a; b_tile b; };
};

// The case's A and B tiles, TMA-loaded into dynamic shared memory (1024-aligned), landed for every thread.
template <typename P>
__device__ typename P::smem_t& load_operands(const typename P::globals& g) {
  extern __shared__ uint8_t raw[];
  auto& s = *reinterpret_cast<typename P::smem_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  __shared__ semaphore loaded;
  if (threadIdx.x == 0) { init_semaphore(loaded, 1); fence_semaphore_init(); }
  __syncthreads();
  if (threadIdx.x == 0) {
    expect_bytes(loaded, tma::bytes<typename P::a_tile>() + tma::bytes<typename P::b_tile>());
    tma::load_async(s.a, g.a, {}, loaded);
    tma::load_async(s.b, g.b, {}, loaded);
  }
  wait(loaded, 0);
  return s;
}

template <int N, int K, bool ARegs, bool BIsNK, bool AIsKM, bool Leading>
__global__ void __launch_bounds__(128) mma_kernel(const __grid_constant__ typename mma_case<N, K, ARegs, BIsNK, AIsKM, Leading>::globals g) {
  using P = mma_case<N, K, ARegs, BIsNK, AIsKM, Leading>;
  auto& s = load_operands<P>(g);
  rt_fl<16, N> d;
  if constexpr (Leading) {
    rt_bf<16, K> a;
    warpgroup::load(a, s.a.ref());
    rt_fl<16, K / 2> lead;  // a's first K / 2 columns, in fp32
#pragma unroll
    for (int j = 0; j < K / 32; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) lead.data[0][j][k] = convert<float2>(a.data[0][j][k]);
    rt_bf<16, K> wide;
    fill(wide, NAN);
    copy_leading(wide, lead);
    zero(d);
    warpgroup::mma_AB_leading(d, wide, s.b.template row_block<K / 2>(0));
  } else if constexpr (AIsKM) {
    warpgroup::mm_AtB(d, s.a, s.b);
  } else if constexpr (ARegs) {
    rt_bf<16, K> a;
    warpgroup::load(a, s.a.ref());
    if constexpr (BIsNK) warpgroup::mm_ABt(d, a, s.b); else warpgroup::mm_AB(d, a, s.b);
  } else {
    if constexpr (BIsNK) warpgroup::mm_ABt(d, s.a, s.b); else warpgroup::mm_AB(d, s.a, s.b);
  }
  warpgroup::mma_async_wait<0>();
  warpgroup::store(g.d, d, {});
}

template <int N, int K, bool ARegs, bool BIsNK, bool AIsKM = false, bool Leading = false>
cudaError_t run_mma(const void* a, const void* b, void* d) {
  using P = mma_case<N, K, ARegs, BIsNK, AIsKM, Leading>;
  typename P::globals g{.a = {(bf16*)a, {1, 1, AIsKM ? K : 64, AIsKM ? 64 : K}},
                        .b = {(bf16*)b, {1, 1, BIsNK ? N : K, BIsNK ? K : N}},
                        .d = {(float*)d, {1, 1, 64, N}}};
  const int smem = sizeof(typename P::smem_t) + 1024;
  auto* fn = &mma_kernel<N, K, ARegs, BIsNK, AIsKM, Leading>;
  cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  fn<<<1, 128, smem>>>(g);
  cudaError_t e = cudaGetLastError();
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

// e4m3 x e4m3: A 64 x K and B N x K, both K-major in shared memory (mm_ABt), fp32 out.
template <int N, int K>
struct mma8_case {
  using a_tile = st<fp8e4m3, 64, K>;
  using b_tile = st<fp8e4m3, N, K>;
  struct globals {
    gl<fp8e4m3, 1, 1, RUNTIME, RUNTIME, a_tile> a;
    gl<fp8e4m3, 1, 1, RUNTIME, RUNTIME, b_tile> b;
    gl<float, 1, 1, RUNTIME, RUNTIME> d;
  };
  struct smem_t { a_tile a; b_tile b; };
};

template <int N, int K>
__global__ void __launch_bounds__(128) mma8_kernel(const __grid_constant__ typename mma8_case<N, K>::globals g) {
  using P = mma8_case<N, K>;
  auto& s = load_operands<P>(g);
  rt_fl<16, N> d;
  warpgroup::mm_ABt(d, s.a, s.b);
  warpgroup::mma_async_wait<0>();
  warpgroup::store(g.d, d, {});
}

template <int N, int K>
cudaError_t run_mma8(const void* a, const void* b, void* d) {
  using P = mma8_case<N, K>;
  typename P::globals g{.a = {(fp8e4m3*)a, {1, 1, 64, K}}, .b = {(fp8e4m3*)b, {1, 1, N, K}},
                        .d = {(float*)d, {1, 1, 64, N}}};
  const int smem = sizeof(typename P::smem_t) + 1024;
  auto* fn = &mma8_kernel<N, K>;
  cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  fn<<<1, 128, smem>>>(g);
  cudaError_t e = cudaGetLastError();
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

// ---- maps, reductions, broadcasts, masks on one warp's 32 x 64 fp32 tile -------------------------
// out rows: [0] x - row_max(x) then exp2, [1] row_sum(x) broadcast, [2] col_sum(x) broadcast, [3] tril(x),
// [4] (row layout only) mask_cols(x) at offset (3, 5), keeping columns [row - 8, row + 20] of each row,
// [5] row_max_leading<2>(x) (the max of each row's first 32 columns) broadcast
using fp32_view = gl<float, 1, RUNTIME, RUNTIME, RUNTIME>;
template <typename Layout>
__global__ void maps_kernel(const __grid_constant__ fp32_view in, const __grid_constant__ fp32_view out) {
  using tile = rt_fl<32, 64, Layout>;
  tile t, r;
  warp::load(t, in, {});
  typename tile::per_row mx, sm;
  typename tile::per_col cs;
  row_max(mx, t);
  row_sum(sm, t);
  col_sum(cs, t);
  sub_row(r, t, mx);
  exp2(r, r);
  auto store = [&](int which, const tile& v) { warp::store(out, v, {.d = which}); };
  store(0, r);
  zero(r);
  add_row(r, r, sm);
  store(1, r);
  zero(r);
  add_col(r, r, cs);
  store(2, r);
  tril(r, t, 0, 0, 0, -1.f);
  store(3, r);
  if constexpr (std::is_same_v<Layout, row_l>) {
    mask_cols(r, t, 3, 5, [](int row, int& lo, int& hi) { lo = row - 8, hi = row + 20; }, -2.f);
    store(4, r);
  }
  fill(mx, -INFINITY);
  row_max_leading<2>(mx, t, mx);
  zero(r);
  add_row(r, r, mx);
  store(5, r);
}

}  // namespace

// ---- shared-memory hand-off through mbarriers, as lcsf's fed tasks do it ------------------------------
// One producer thread writes a 12-word record into a ring of two slots and arrives on its `full` semaphore; each of
// four consumer warps waits, copies the record (every lane reads it: lcsf::warp_uniform_copy), __syncwarp, and its
// lane 0 arrives on the slot's `empty`, which the producer waits on before it rewrites the slot. The sums show
// every record arrived whole. racecheck reports read / write hazards on it (thousands on the H200), as on
// the fed-task ring of the D=64 prefill kernel: the tool does not follow this ordering.
struct handoff_record { int w[12]; };
__global__ void __launch_bounds__(160) handoff_kernel(int rounds, int* out) {
  __shared__ handoff_record slot[2];
  __shared__ semaphore full[2], empty[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; s++) init_semaphore(full[s], 1), init_semaphore(empty[s], 4);
    fence_semaphore_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp == 4) {  // producer
    if (laneid() == 0)
      for (int r = 0; r < rounds; r++) {
        const int s = r & 1, phase = (r >> 1) & 1;
        wait(empty[s], phase ^ 1);  // a fresh semaphore passes at once
        for (int i = 0; i < 12; i++) slot[s].w[i] = r * 12 + i;
        arrive(full[s]);
      }
    return;
  }
  long sum = 0;
  for (int r = 0; r < rounds; r++) {
    const int s = r & 1, phase = (r >> 1) & 1;
    wait(full[s], phase);
    const handoff_record rec = lcsf::warp_uniform_copy(slot[s]);
    __syncwarp();
    if (laneid() == 0) arrive(empty[s]);
    for (int i = 0; i < 12; i++) sum += rec.w[i];
  }
  if (laneid() == 0) out[warp] = int(sum % 1000000007);
}

extern "C" {

int tk_prim_handoff(int rounds, int* out) {
  handoff_kernel<<<1, 160>>>(rounds, out);
  cudaError_t e = cudaGetLastError();
  return int(e != cudaSuccess ? e : cudaDeviceSynchronize());
}

int tk_prim_roundtrip(int variant, const void* in, void* out, int rows, int cols) {
  switch (variant) {
    case 0: return run_roundtrip<bf16, 64, 16, row_l>(in, out, rows, cols);   // 32B swizzle
    case 1: return run_roundtrip<bf16, 64, 32, row_l>(in, out, rows, cols);   // 64B swizzle
    case 2: return run_roundtrip<bf16, 64, 64, row_l>(in, out, rows, cols);   // 128B swizzle
    case 3: return run_roundtrip<bf16, 128, 192, row_l>(in, out, rows, cols); // 128B, three chunks
    case 4: return run_roundtrip<bf16, 64, 64, col_l>(in, out, rows, cols);   // column-layout registers
    case 5: return run_roundtrip<float, 64, 32, row_l>(in, out, rows, cols);  // fp32, 128B swizzle
    default: return int(cudaErrorInvalidValue);
  }
}

// variant bits: 0 = A in registers, 1 = B given as N x K; 4: A given as K x 64 (transposed); 5: leading columns
int tk_prim_mma(int n, int variant, const void* a, const void* b, void* d) {
#define TK_CASE(N)                                                       \
  if (n == N) switch (variant) {                                         \
      case 0: return run_mma<N, 64, false, false>(a, b, d);              \
      case 1: return run_mma<N, 64, true, false>(a, b, d);               \
      case 2: return run_mma<N, 64, false, true>(a, b, d);               \
      case 3: return run_mma<N, 64, true, true>(a, b, d);                \
      case 4: return run_mma<N, 64, false, false, true>(a, b, d);        \
      case 5: return run_mma<N, 64, true, false, false, true>(a, b, d);  \
    }
  TK_CASE(16) TK_CASE(64) TK_CASE(128) TK_CASE(256)
#undef TK_CASE
  return int(cudaErrorInvalidValue);
}

// e4m3 A (64 x k) times B^T (B: n x k), k 64 or 128
int tk_prim_mma8(int n, int k, const void* a, const void* b, void* d) {
#define TK_CASE(N)                                   \
  if (n == N) {                                      \
    if (k == 64) return run_mma8<N, 64>(a, b, d);    \
    if (k == 128) return run_mma8<N, 128>(a, b, d);  \
  }
  TK_CASE(16) TK_CASE(64) TK_CASE(128) TK_CASE(256)
#undef TK_CASE
  return int(cudaErrorInvalidValue);
}

int tk_prim_maps(int col_layout, const float* x, float* out) {
  const fp32_view in{const_cast<float*>(x), {1, 1, 32, 64}}, o{out, {1, 6, 32, 64}};
  if (col_layout) maps_kernel<col_l><<<1, 32>>>(in, o);
  else maps_kernel<row_l><<<1, 32>>>(in, o);
  cudaError_t e = cudaGetLastError();
  return int(e != cudaSuccess ? e : cudaDeviceSynchronize());
}

}  // extern "C"
