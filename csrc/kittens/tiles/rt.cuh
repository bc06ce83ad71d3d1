// Register tiles and register vectors, built from 16x16 fragments held by one warp.
//
// Fragment ownership (lane = threadIdx % 32, g = lane / 4, q = lane % 4), element pair e in {x, y}:
//   row layout: data[i][j][k] holds rows 16i + g + 8*(k&1), columns 16j + 2q + 8*(k>>1) + e
//               (the mma/wgmma accumulator and A-operand layout)
//   col layout: the transpose: columns 16j + g + 8*(k&1), rows 16i + 2q + 8*(k>>1) + e
// A warpgroup-wide wgmma result of 64 x N is four per-warp rt<float, 16, N>, warp w holding rows 16w..16w+15.
#pragma once
#include "../core/ids.cuh"
#include "../core/types.cuh"

namespace kittens {

struct row_l {};
struct col_l {};
template <typename L> concept rt_layout = std::is_same_v<L, row_l> || std::is_same_v<L, col_l>;

// Where fragment slot (k, e) of a lane sits, per layout; one implementation of every op uses these.
template <rt_layout L> struct frag;
template <> struct frag<row_l> {
  __device__ static __forceinline__ int row(int k, int /*e*/) { return (laneid() >> 2) + 8 * (k & 1); }
  __device__ static __forceinline__ int col(int k, int e) { return 2 * (laneid() & 3) + 8 * (k >> 1) + e; }
  // slot of (k, e) in a per-row vector (2 rows a lane) and in a per-column vector (4 columns a lane)
  __host__ __device__ static constexpr int row_slot(int k, int /*e*/) { return k & 1; }
  __host__ __device__ static constexpr int col_slot(int k, int e) { return 2 * (k >> 1) + e; }
  static constexpr int rows_per_lane = 2, cols_per_lane = 4;
  static constexpr int row_shuffle_lo = 1, row_shuffle_hi = 2;   // lanes sharing a row: xor 1, 2
  static constexpr int col_shuffle_lo = 4, col_shuffle_hi = 16;  // lanes sharing a column: xor 4, 8, 16
};
template <> struct frag<col_l> {
  __device__ static __forceinline__ int row(int k, int e) { return 2 * (laneid() & 3) + 8 * (k >> 1) + e; }
  __device__ static __forceinline__ int col(int k, int /*e*/) { return (laneid() >> 2) + 8 * (k & 1); }
  __host__ __device__ static constexpr int row_slot(int k, int e) { return 2 * (k >> 1) + e; }
  __host__ __device__ static constexpr int col_slot(int k, int /*e*/) { return k & 1; }
  static constexpr int rows_per_lane = 4, cols_per_lane = 2;
  static constexpr int row_shuffle_lo = 4, row_shuffle_hi = 16;
  static constexpr int col_shuffle_lo = 1, col_shuffle_hi = 2;
};

// Register vector of Len values spread over a warp, PerLane16 values per lane for every 16 entries.
template <element T, int Len, int PerLane16>
struct rv {
  static_assert(Len % 16 == 0, "register vectors cover whole 16-entry fragments");
  using dtype = T;
  static constexpr int length = Len, blocks = Len / 16, per_lane = PerLane16;
  T data[blocks][PerLane16];
};

template <element T, int R, int C, rt_layout L = row_l>
struct rt {
  static_assert(R % 16 == 0 && C % 16 == 0,
                "register tiles are built from 16x16 fragments: rows and cols must be multiples of 16");
  using dtype = T;
  using layout = L;
  using T2 = packed<T>;
  static constexpr int rows = R, cols = C, height = R / 16, width = C / 16;
  T2 data[height][width][4];

  using per_row = rv<T, R, frag<L>::rows_per_lane>;  // one value per row (row_max, row_sum, ...)
  using per_col = rv<T, C, frag<L>::cols_per_lane>;  // one value per column
};

template <int R, int C, rt_layout L = row_l> using rt_fl = rt<float, R, C, L>;
template <int R, int C, rt_layout L = row_l> using rt_bf = rt<bf16, R, C, L>;
template <int R, int C, rt_layout L = row_l> using rt_hf = rt<half, R, C, L>;

template <typename X> struct is_rt : std::false_type {};
template <typename T, int R, int C, typename L> struct is_rt<rt<T, R, C, L>> : std::true_type {};
template <typename X> concept register_tile = is_rt<X>::value;
template <typename X> concept row_register_tile = register_tile<X> && std::is_same_v<typename X::layout, row_l>;

template <typename X> struct is_rv : std::false_type {};
template <typename T, int N, int P> struct is_rv<rv<T, N, P>> : std::true_type {};
template <typename X> concept register_vector = is_rv<X>::value;

// Visit every element a lane holds: f(i, j, k, e) with (i, j) the fragment, k the pair, e the element.
template <register_tile RT, typename F>
__device__ __forceinline__ void for_each_element(F&& f) {
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int j = 0; j < RT::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++)
#pragma unroll
        for (int e = 0; e < 2; e++) f(i, j, k, e);
}

template <typename T2> __device__ __forceinline__ auto& elem(T2& p, int e) { return e ? p.y : p.x; }
template <typename T2> __device__ __forceinline__ const auto& elem(const T2& p, int e) { return e ? p.y : p.x; }

}  // namespace kittens
