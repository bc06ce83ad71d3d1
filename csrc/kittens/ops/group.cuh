// Scoped operations: one implementation for a warp (group<1>) and a warpgroup (group<4>).
// Work on shared / global memory is split over the group's threads; register tiles are per warp, and a
// group-level register <-> shared copy gives warp w the w-th row block of the shared tile.
#pragma once
#include "../tiles/gl.cuh"
#include "../tiles/rt.cuh"
#include "../tiles/st.cuh"
#include "shared_access.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace kittens {

template <int NW>
struct group {
  static_assert(NW == 1 || NW == 2 || NW == 4 || NW == 8, "a group is 1, 2, 4 or 8 warps");
  static constexpr int warps = NW, threads = NW * WARP_THREADS;
  __device__ static __forceinline__ int thread() { return threadIdx.x % threads; }
  __device__ static __forceinline__ int warp() { return (threadIdx.x / WARP_THREADS) % NW; }

  // Barrier among this group's threads only (named barrier `id`, 1..15; 0 is __syncthreads).
  __device__ static __forceinline__ void sync(int id) {
    if constexpr (NW == 1) __syncwarp();
    else asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(threads) : "memory");
  }

  // Named barrier `id` shared by `count` threads (several groups): sync waits, arrive only signals.
  // Two warpgroups taking turns on the tensor cores use a pair of these (see the attention kernel).
  __device__ static __forceinline__ void sync_with(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
  }
  __device__ static __forceinline__ void arrive_at(int id, int count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
  }

  // Whether `pred` holds in every thread of the group: one vote, the same answer in all its warps (named barrier
  // `id`, as sync; a warp's __all_sync answers for the warp only).
  __device__ static __forceinline__ bool all(int id, bool pred) {
    if constexpr (NW == 1) {
      return __all_sync(0xffffffffu, pred);
    } else {
      int r;
      asm volatile(
          "{\n.reg .pred p, q;\nsetp.ne.b32 p, %1, 0;\nbar.red.and.pred q, %2, %3, p;\nselp.b32 %0, 1, 0, q;\n}"
          : "=r"(r)
          : "r"(int(pred)), "r"(id), "n"(threads)
          : "memory");
      return r != 0;
    }
  }

  // ---- registers <-> shared ------------------------------------------------------------------------
  // Each warp moves its row block: dst rows = src rows / NW.
  // 16-bit tiles move a 16x16 fragment per ldmatrix/stmatrix.x4 (the col layout through .trans); other
  // element types move pairs with plain shared loads/stores. Lane l addresses row l % 8 of 8x8 block l / 8,
  // blocks ordered as the fragment's four registers.
  template <typename L> __device__ static __forceinline__ void block_origin(int k, int& r, int& c) {
    if constexpr (std::is_same_v<L, row_l>) r = 8 * (k & 1), c = 8 * (k >> 1);
    else r = 8 * (k >> 1), c = 8 * (k & 1);
  }

  template <register_tile RT, shared_tile SR>
  __device__ static __forceinline__ void load(RT& dst, const SR& src) {
    static_assert(SR::rows == RT::rows * NW && SR::cols == RT::cols,
                  "group load: the shared tile must be (warps x register-tile rows) by the same cols");
    const auto block = src.template row_block<RT::rows>(warp());
    using L = typename RT::layout;
    using F = frag<L>;
    using S = typename SR::dtype;
    constexpr bool transpose = std::is_same_v<L, col_l>;
#pragma unroll
    for (int i = 0; i < RT::height; i++)
#pragma unroll
      for (int j = 0; j < RT::width; j++) {
        if constexpr (sizeof(S) == 2) {
          int r, c;
          block_origin<L>(laneid() / 8, r, c);
          uint32_t regs[4];
          detail::ldmatrix_x4<transpose>(regs, block.addr(16 * i + r + laneid() % 8, 16 * j + c));
#pragma unroll
          for (int k = 0; k < 4; k++) dst.data[i][j][k] = recast<typename RT::T2>(*reinterpret_cast<packed<S>*>(&regs[k]));
        } else {
#pragma unroll
          for (int k = 0; k < 4; k++) {
            const int r = 16 * i + F::row(k, 0), c = 16 * j + F::col(k, 0);
            float2 v;
            if constexpr (transpose) v = {convert<float>(detail::ld_shared<S>(block.addr(r, c))),
                                          convert<float>(detail::ld_shared<S>(block.addr(r + 1, c)))};
            else v = convert<float2>(detail::ld_shared<packed<S>>(block.addr(r, c)));
            dst.data[i][j][k] = convert<typename RT::T2>(v);
          }
        }
      }
  }

  // Transposing load (16-bit tiles): warp w takes the transpose of src's column block
  // [w * RT::rows, (w + 1) * RT::rows), so src rows become dst columns. This is how an operand whose
  // reduction dim runs along a shared tile's rows (x^T in x^T B) becomes a register A operand of wgmma.
  template <register_tile RT, shared_tile SR>
  __device__ static __forceinline__ void load_t(RT& dst, const SR& src) {
    static_assert(SR::cols == RT::rows * NW && SR::rows == RT::cols,
                  "group load_t: the shared tile must be (register-tile cols) by (warps x register-tile rows)");
    static_assert(sizeof(typename SR::dtype) == 2 && std::is_same_v<typename RT::layout, row_l>,
                  "group load_t: 16-bit shared tile into a row-layout register tile");
    using S = typename SR::dtype;
    const int col_base = warp() * RT::rows, m = laneid() / 8;
#pragma unroll
    for (int i = 0; i < RT::height; i++)
#pragma unroll
      for (int j = 0; j < RT::width; j++) {
        // 8x8 matrix m of fragment (i, j) is dst rows 16i + 8(m & 1), cols 16j + 8(m >> 1): src transposed
        uint32_t regs[4];
        detail::ldmatrix_x4<true>(regs, src.addr(16 * j + 8 * (m >> 1) + laneid() % 8, col_base + 16 * i + 8 * (m & 1)));
#pragma unroll
        for (int k = 0; k < 4; k++) dst.data[i][j][k] = recast<typename RT::T2>(*reinterpret_cast<packed<S>*>(&regs[k]));
      }
  }

  template <shared_tile SR, register_tile RT>
  __device__ static __forceinline__ void store(const SR& dst, const RT& src) {
    static_assert(SR::rows == RT::rows * NW && SR::cols == RT::cols,
                  "group store: the shared tile must be (warps x register-tile rows) by the same cols");
    const auto block = dst.template row_block<RT::rows>(warp());
    using L = typename RT::layout;
    using F = frag<L>;
    using S = typename SR::dtype;
    constexpr bool transpose = std::is_same_v<L, col_l>;
#pragma unroll
    for (int i = 0; i < RT::height; i++)
#pragma unroll
      for (int j = 0; j < RT::width; j++) {
        if constexpr (sizeof(S) == 2) {
          uint32_t regs[4];
#pragma unroll
          for (int k = 0; k < 4; k++) {
            const packed<S> p = recast<packed<S>>(src.data[i][j][k]);
            regs[k] = *reinterpret_cast<const uint32_t*>(&p);
          }
          int r, c;
          block_origin<L>(laneid() / 8, r, c);
          detail::stmatrix_x4<transpose>(block.addr(16 * i + r + laneid() % 8, 16 * j + c), regs);
        } else {
#pragma unroll
          for (int k = 0; k < 4; k++) {
            const int r = 16 * i + F::row(k, 0), c = 16 * j + F::col(k, 0);
            const float2 v = convert<float2>(src.data[i][j][k]);
            if constexpr (transpose) {
              detail::st_shared(block.addr(r, c), convert<S>(v.x));
              detail::st_shared(block.addr(r + 1, c), convert<S>(v.y));
            } else {
              detail::st_shared(block.addr(r, c), convert<packed<S>>(v));
            }
          }
        }
      }
  }

  // ---- registers <-> global (bounds-checked: rows >= src.rows() and cols >= src.cols() read as 0) --
  template <register_tile RT, typename GL>
  __device__ static __forceinline__ void load(RT& dst, const GL& src, coord c) {
    using F = frag<typename RT::layout>;
    const int row0 = c.row + warp() * RT::rows;
    for_each_element<RT>([&](int i, int j, int k, int e) {
      const int r = row0 + 16 * i + F::row(k, e), col = c.col + 16 * j + F::col(k, e);
      float v = 0.f;
      if (r < src.rows() && col < src.cols()) v = convert<float>(*src.at({c.b, c.d, r, col}));
      elem(dst.data[i][j][k], e) = convert<typename RT::dtype>(v);
    });
  }
  // Rows at or past row_limit (e.g. the end of a packed sequence) are not written either.
  template <typename GL, register_tile RT>
  __device__ static __forceinline__ void store(const GL& dst, const RT& src, coord c, long row_limit = 1L << 62) {
    using F = frag<typename RT::layout>;
    using T = typename GL::dtype;
    const int row0 = c.row + warp() * RT::rows;
    const long rows = dst.rows() < row_limit ? dst.rows() : row_limit;
    if constexpr (std::is_same_v<typename RT::layout, row_l> && (sizeof(T) == 2 || sizeof(T) == 4)) {
      // Row layout: a lane holds two rows of each 16-row fragment and, in each, pairs of adjacent columns. So
      // one address a row (the pairs sit at constant offsets from it) and one store a pair (4 bytes, or 8 for
      // fp32) where the row's address allows it (Based's states have rows of D + 1 floats: odd rows are not);
      // columns are checked only for a tile that crosses the tensor's last column.
      const int lane_col = F::col(0, 0);  // 2 * (lane % 4)
      const bool cols_inside = c.col + RT::cols <= dst.cols();
#pragma unroll
      for (int i = 0; i < RT::height; i++)
#pragma unroll
        for (int half = 0; half < 2; half++) {  // fragment values k = half, half + 2: rows lane / 4 (+ 8)
          const int r = row0 + 16 * i + F::row(half, 0);
          if (r >= rows) continue;
          T* row_ptr = dst.at({c.b, c.d, r, c.col}) + lane_col;
          const bool pairs = reinterpret_cast<uintptr_t>(row_ptr) % sizeof(packed<T>) == 0;  // offsets are even
#pragma unroll
          for (int j = 0; j < RT::width; j++)
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
              const auto& v = src.data[i][j][half + 2 * kk];
              const int offset = 16 * j + 8 * kk, col = c.col + lane_col + offset;
              const T x = convert<T>(convert<float>(elem(v, 0)));
              const T y = convert<T>(convert<float>(elem(v, 1)));
              if (pairs && (cols_inside || col + 1 < dst.cols())) {
                *reinterpret_cast<packed<T>*>(row_ptr + offset) = packed<T>{x, y};
              } else {
                if (col < dst.cols()) row_ptr[offset] = x;
                if (col + 1 < dst.cols()) row_ptr[offset + 1] = y;
              }
            }
        }
    } else {
      store_each(dst, src, c, row_limit);
    }
  }
  // The same, one element at a time with a full address each: less code than store's paired path, for a store
  // that runs rarely (prefill's ragged last query tile, where the paired path cost the kernels ~2%).
  template <typename GL, register_tile RT>
  __device__ static __forceinline__ void store_each(const GL& dst, const RT& src, coord c, long row_limit = 1L << 62) {
    using F = frag<typename RT::layout>;
    const int row0 = c.row + warp() * RT::rows;
    const long rows = dst.rows() < row_limit ? dst.rows() : row_limit;
    for_each_element<RT>([&](int i, int j, int k, int e) {
      const int r = row0 + 16 * i + F::row(k, e), col = c.col + 16 * j + F::col(k, e);
      if (r < rows && col < dst.cols())
        *dst.at({c.b, c.d, r, col}) = convert<typename GL::dtype>(convert<float>(elem(src.data[i][j][k], e)));
    });
  }

  // ---- shared <-> global without TMA (16-byte vectors, bounds-checked, zero fill) ---------------------
  // For addresses TMA cannot express. Needs cols * sizeof(T) % 16 == 0 and 16-byte aligned rows.
  template <shared_tile SR, typename GL>
  __device__ static __forceinline__ void load(const SR& dst, const GL& src, coord c) {
    using T = typename SR::dtype;
    constexpr int per_vec = 16 / sizeof(T), vecs = SR::rows * SR::cols / per_vec;
    for (int v = thread(); v < vecs; v += threads) {
      const int r = v / (SR::cols / per_vec), col = (v % (SR::cols / per_vec)) * per_vec;
      uint4 x{0, 0, 0, 0};
      if (c.row + r < src.rows() && c.col + col < src.cols())
        x = *reinterpret_cast<const uint4*>(src.at({c.b, c.d, c.row + r, c.col + col}));
      detail::st_shared_16B(dst.addr(r, col), x);
    }
  }
  template <typename GL, shared_tile SR>
  __device__ static __forceinline__ void store(const GL& dst, const SR& src, coord c) {
    using T = typename SR::dtype;
    constexpr int per_vec = 16 / sizeof(T), vecs = SR::rows * SR::cols / per_vec;
    for (int v = thread(); v < vecs; v += threads) {
      const int r = v / (SR::cols / per_vec), col = (v % (SR::cols / per_vec)) * per_vec;
      if (c.row + r < dst.rows() && c.col + col < dst.cols())
        *reinterpret_cast<uint4*>(dst.at({c.b, c.d, c.row + r, c.col + col})) = detail::ld_shared_16B<T>(src.addr(r, col));
    }
  }

  // Rows [first_row, rows) of a shared tile set to 0 (16-byte stores, swizzle applied). For the rows of a
  // tile that TMA filled from a whole page past a sequence's end: masked scores give P = 0 there, but
  // 0 * (NaN or Inf left in a recycled page) is NaN in P V, so those V rows must hold finite values.
  // Ends with the proxy fence and the group barrier `barrier`, so wgmma may read the tile next.
  template <shared_tile SR>
  __device__ static __forceinline__ void zero_rows(const SR& dst, int first_row, int barrier) {
    using T = typename SR::dtype;
    constexpr int per_vec = 16 / sizeof(T), vecs_per_row = SR::cols / per_vec;
    const int first = first_row < 0 ? 0 : first_row;
    for (int v = first * vecs_per_row + thread(); v < SR::rows * vecs_per_row; v += threads)
      detail::st_shared_16B(dst.addr(v / vecs_per_row, (v % vecs_per_row) * per_vec), uint4{0, 0, 0, 0});
    fence_async_shared();  // generic-proxy writes, then wgmma (async proxy) reads
    sync(barrier);
  }

  // ---- warpgroup matrix multiply (wgmma), warpgroup scope only --------------------------------------
  // d: per-warp rt_fl<16, N> (the warpgroup's 64 x N); a: rt<16, K> per warp, a 64 x K shared tile, or
  // (mm_AtB / mma_AtB) a K x 64 shared tile used transposed; b: K x N (mm_AB / mma_AB / *_AtB) or N x K
  // (mm_ABt / mma_ABt) shared tile. mm_* overwrite d, mma_* add to it.
  // Each call issues its k-steps and commits them as one group; mma_async_wait<n>() retires groups.
  // ALeading: a is a register tile of which only the first K columns (K = b's rows) are multiplied.
  template <bool Accumulate, bool BIsNK, typename D, typename A, typename B, bool AIsKM = false, bool ALeading = false>
  __device__ static __forceinline__ void mma(D& d, const A& a, const B& b_tile) requires(NW == 4) {
    const auto b = as_ref(b_tile);
    using BR = std::remove_cv_t<decltype(b)>;
    using T = typename BR::dtype;
    constexpr int K = ALeading ? BR::rows : AIsKM ? A::rows : A::cols;
    static_assert(!ALeading || (register_tile<A> && !BIsNK && K <= A::cols),
                  "mma_AB_leading: a register A of at least b's rows in columns");
    static_assert(std::is_same_v<typename A::dtype, T>, "wgmma: A and B must have the same element type");
    constexpr int KSTEP = 32 / int(sizeof(T));  // a k-step's elements: 16 of a 16-bit type, 32 of e4m3
    static_assert(K % KSTEP == 0, "wgmma: the reduction dim must be a multiple of 16 (32 for e4m3)");
    static_assert(sizeof(T) == 2 || (BIsNK && !register_tile<A> && !AIsKM && !ALeading),
                  "e4m3 wgmma: mm_ABt / mma_ABt with A (64 x K) and B (N x K) in shared memory");
    if constexpr (BIsNK) static_assert(BR::rows == D::cols && BR::cols == K, "mma_ABt: b must be N x K");
    else static_assert(BR::rows == K && BR::cols == D::cols, "mma_AB: b must be K x N");
    wgmma::fence_operand(d);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < K / KSTEP; ks++) {
      const int scale_d = (Accumulate || ks > 0) ? 1 : 0;
      const uint64_t desc_b = wgmma::descriptor<BIsNK>(b, ks);
      if constexpr (register_tile<A>) {
        static_assert(A::rows == 16 && std::is_same_v<typename A::layout, row_l>,
                      "wgmma: a register A operand is a per-warp rt<16, K> in row layout");
        const uint32_t* regs = reinterpret_cast<const uint32_t*>(&a.data[0][ks][0]);
        wgmma::mma_step<T, true, BIsNK ? 0 : 1>(d, regs, 0, desc_b, scale_d);
      } else if constexpr (AIsKM) {
        const auto ar = as_ref(a);
        static_assert(decltype(ar)::cols == 64, "wgmma: a transposed shared A operand is K x 64 (the warpgroup's M)");
        wgmma::mma_step<T, false, BIsNK ? 0 : 1, D, 1>(d, nullptr, wgmma::descriptor<false>(ar, ks), desc_b, scale_d);
      } else {
        const auto ar = as_ref(a);
        static_assert(decltype(ar)::rows == 64, "wgmma: a shared A operand is 64 rows (the warpgroup's M)");
        wgmma::mma_step<T, false, BIsNK ? 0 : 1>(d, nullptr, wgmma::descriptor<true>(ar, ks), desc_b, scale_d);
      }
    }
    wgmma::commit_group();
    wgmma::fence_operand(d);
  }
  template <typename D, typename A, typename B> __device__ static __forceinline__ void mm_AB(D& d, const A& a, const B& b) requires(NW == 4) { mma<false, false>(d, a, b); }
  template <typename D, typename A, typename B> __device__ static __forceinline__ void mma_AB(D& d, const A& a, const B& b) requires(NW == 4) { mma<true, false>(d, a, b); }
  // d += a[:, :K] b, K = b's rows: a register A tile's leading columns only (e.g. probabilities of a tile whose
  // trailing keys no row sees, against those keys' rows of V alone).
  template <typename D, typename A, typename B> __device__ static __forceinline__ void mma_AB_leading(D& d, const A& a, const B& b) requires(NW == 4) { mma<true, false, D, A, B, false, true>(d, a, b); }
  template <typename D, typename A, typename B> __device__ static __forceinline__ void mm_ABt(D& d, const A& a, const B& b) requires(NW == 4) { mma<false, true>(d, a, b); }
  template <typename D, typename A, typename B> __device__ static __forceinline__ void mma_ABt(D& d, const A& a, const B& b) requires(NW == 4) { mma<true, true>(d, a, b); }
  // d (+)= a^T b with a a K x 64 shared tile (e.g. tokens x features): no transposed copy is made.
  template <typename D, typename A, typename B> __device__ static __forceinline__ void mm_AtB(D& d, const A& a, const B& b) requires(NW == 4 && !register_tile<A>) { mma<false, false, D, A, B, true>(d, a, b); }
  template <typename D, typename A, typename B> __device__ static __forceinline__ void mma_AtB(D& d, const A& a, const B& b) requires(NW == 4 && !register_tile<A>) { mma<true, false, D, A, B, true>(d, a, b); }
  template <int Pending = 0> __device__ static __forceinline__ void mma_async_wait() requires(NW == 4) { wgmma::wait_group<Pending>(); }

  // ---- register budget (setmaxnreg): each role of a warp-specialised kernel resizes its own file -----
  template <int N> __device__ static __forceinline__ void increase_registers() requires(NW == 4) {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
  }
  template <int N> __device__ static __forceinline__ void decrease_registers() requires(NW == 4) {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
  }
};

using warp = group<1>;
using warpgroup = group<4>;

}  // namespace kittens
