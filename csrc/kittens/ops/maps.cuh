// Register-tile arithmetic: fills, conversions, element-wise maps, row/column reductions and
// broadcasts, masks. Destination first; every op works on both fragment layouts through frag<L>.
#pragma once
#include <cfloat>
#include "../tiles/rt.cuh"

namespace kittens {

namespace op {
struct add { template <typename T> __device__ static T apply(T a, T b) { return a + b; } static constexpr float identity = 0.f; };
struct mul { template <typename T> __device__ static T apply(T a, T b) { return a * b; } static constexpr float identity = 1.f; };
struct sub { template <typename T> __device__ static T apply(T a, T b) { return a - b; } };
struct div { template <typename T> __device__ static T apply(T a, T b) { return a / b; } };
struct max { __device__ static float apply(float a, float b) { return fmaxf(a, b); } static constexpr float identity = -INFINITY; };
struct min { __device__ static float apply(float a, float b) { return fminf(a, b); } static constexpr float identity = INFINITY; };
}  // namespace op

// 2^x on the special-function unit (ex2.approx.ftz: ~2 ulp, denormals flushed; 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {  // lg2.approx: log2(0) = -inf, so fast_exp2 of it is 0
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- element-wise --------------------------------------------------------------------------------
// dst = f(src) element by element, in fp32, then converted to dst's type.
template <register_tile D, register_tile S, typename F>
__device__ __forceinline__ void map(D& dst, const S& src, F f) {
  static_assert(D::rows == S::rows && D::cols == S::cols && std::is_same_v<typename D::layout, typename S::layout>,
                "map: tiles must have the same shape and layout");
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 v = convert<float2>(src.data[i][j][k]);
        dst.data[i][j][k] = convert<typename D::T2>(float2{f(v.x), f(v.y)});
      }
}
// dst = f(a, b) element by element.
template <register_tile D, register_tile A, register_tile B, typename F>
__device__ __forceinline__ void map(D& dst, const A& a, const B& b, F f) {
  static_assert(D::rows == A::rows && D::cols == A::cols && A::rows == B::rows && A::cols == B::cols,
                "map: tiles must have the same shape");
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 x = convert<float2>(a.data[i][j][k]), y = convert<float2>(b.data[i][j][k]);
        dst.data[i][j][k] = convert<typename D::T2>(float2{f(x.x, y.x), f(x.y, y.y)});
      }
}

// dst = f(a, b, row, col), positions as in map_at below.
template <register_tile D, register_tile A, register_tile B, typename F>
__device__ __forceinline__ void map_at(D& dst, const A& a, const B& b, int row0, int col0, F f) {
  static_assert(D::rows == A::rows && D::cols == A::cols && A::rows == B::rows && A::cols == B::cols &&
                std::is_same_v<typename D::layout, typename A::layout> &&
                std::is_same_v<typename A::layout, typename B::layout>,
                "map_at: tiles must have the same shape and layout");
  using Fr = frag<typename A::layout>;
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 x = convert<float2>(a.data[i][j][k]), y = convert<float2>(b.data[i][j][k]);
        const int r = row0 + 16 * i, c = col0 + 16 * j;
        dst.data[i][j][k] = convert<typename D::T2>(float2{f(x.x, y.x, r + Fr::row(k, 0), c + Fr::col(k, 0)),
                                                           f(x.y, y.y, r + Fr::row(k, 1), c + Fr::col(k, 1))});
      }
}

// dst = f(src, row, col) with (row, col) the element's position in this warp's tile offset by (row0, col0):
// position-dependent scaling (decay masks, per-column vectors read from memory).
template <register_tile D, register_tile S, typename F>
__device__ __forceinline__ void map_at(D& dst, const S& src, int row0, int col0, F f) {
  map_at(dst, src, src, row0, col0, [=](float v, float, int r, int c) { return f(v, r, c); });
}

template <register_tile D> __device__ __forceinline__ void fill(D& dst, float v) { map(dst, dst, [v](float) { return v; }); }
template <register_tile D> __device__ __forceinline__ void zero(D& dst) { fill(dst, 0.f); }
// Type conversion (e.g. fp32 accumulators to a bf16 wgmma A operand: same fragment layout).
template <register_tile D, register_tile S> __device__ __forceinline__ void copy(D& dst, const S& src) { map(dst, src, [](float x) { return x; }); }
// dst's first S::cols columns = src, converted (e.g. a narrower score tile into a wider A operand whose leading
// columns alone are multiplied: warpgroup::mma_AB_leading); dst's other columns keep their values.
template <register_tile D, register_tile S>
__device__ __forceinline__ void copy_leading(D& dst, const S& src) {
  static_assert(D::rows == S::rows && D::cols >= S::cols && std::is_same_v<typename D::layout, typename S::layout>,
                "copy_leading: as many rows, at least as many columns, the same layout");
#pragma unroll
  for (int i = 0; i < S::height; i++)
#pragma unroll
    for (int j = 0; j < S::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) dst.data[i][j][k] = convert<typename D::T2>(convert<float2>(src.data[i][j][k]));
}

template <register_tile D, register_tile S> __device__ __forceinline__ void exp2(D& d, const S& s) { map(d, s, [](float x) { return fast_exp2(x); }); }
template <register_tile D, register_tile S> __device__ __forceinline__ void exp(D& d, const S& s) { map(d, s, [](float x) { return __expf(x); }); }
template <register_tile D, register_tile S> __device__ __forceinline__ void log(D& d, const S& s) { map(d, s, [](float x) { return __logf(x); }); }
template <register_tile D, register_tile S> __device__ __forceinline__ void abs(D& d, const S& s) { map(d, s, [](float x) { return fabsf(x); }); }
template <register_tile D, register_tile S> __device__ __forceinline__ void tanh(D& d, const S& s) { map(d, s, [](float x) { return tanhf(x); }); }

#define TK_BINARY_MAP(name, expr)                                                                        \
  template <register_tile D, register_tile A, register_tile B>                                           \
  __device__ __forceinline__ void name(D& d, const A& a, const B& b) { map(d, a, b, [](float x, float y) { return expr; }); } \
  template <register_tile D, register_tile A>                                                            \
  __device__ __forceinline__ void name(D& d, const A& a, float y) { map(d, a, [y](float x) { return expr; }); }
TK_BINARY_MAP(add, x + y)
TK_BINARY_MAP(sub, x - y)
TK_BINARY_MAP(mul, x * y)
TK_BINARY_MAP(div, x / y)
TK_BINARY_MAP(max, fmaxf(x, y))
TK_BINARY_MAP(min, fminf(x, y))
#undef TK_BINARY_MAP

// ---- vectors -------------------------------------------------------------------------------------
template <register_vector V, typename F> __device__ __forceinline__ void map(V& dst, const V& src, F f) {
#pragma unroll
  for (int b = 0; b < V::blocks; b++)
#pragma unroll
    for (int s = 0; s < V::per_lane; s++) dst.data[b][s] = convert<typename V::dtype>(f(convert<float>(src.data[b][s])));
}
template <register_vector V, typename F> __device__ __forceinline__ void map(V& dst, const V& a, const V& b2, F f) {
#pragma unroll
  for (int b = 0; b < V::blocks; b++)
#pragma unroll
    for (int s = 0; s < V::per_lane; s++)
      dst.data[b][s] = convert<typename V::dtype>(f(convert<float>(a.data[b][s]), convert<float>(b2.data[b][s])));
}
template <register_vector V> __device__ __forceinline__ void fill(V& v, float x) { map(v, v, [x](float) { return x; }); }
template <register_vector V> __device__ __forceinline__ void zero(V& v) { fill(v, 0.f); }
template <register_vector V> __device__ __forceinline__ void exp2(V& d, const V& s) { map(d, s, [](float x) { return fast_exp2(x); }); }
template <register_vector V> __device__ __forceinline__ void add(V& d, const V& a, const V& b) { map(d, a, b, [](float x, float y) { return x + y; }); }
template <register_vector V> __device__ __forceinline__ void sub(V& d, const V& a, const V& b) { map(d, a, b, [](float x, float y) { return x - y; }); }
template <register_vector V> __device__ __forceinline__ void mul(V& d, const V& a, const V& b) { map(d, a, b, [](float x, float y) { return x * y; }); }
template <register_vector V> __device__ __forceinline__ void mul(V& d, const V& a, float y) { map(d, a, [y](float x) { return x * y; }); }
template <register_vector V> __device__ __forceinline__ void max(V& d, const V& a, const V& b) { map(d, a, b, [](float x, float y) { return fmaxf(x, y); }); }
template <register_vector V> __device__ __forceinline__ void copy(V& d, const V& s) { map(d, s, [](float x) { return x; }); }

// ---- reductions ------------------------------------------------------------------------------------
namespace detail {
// out = reduce over rows (AlongRows: one result per row) or columns of t, folded into init if given. Without
// AcrossLanes each lane keeps its own share (the lanes holding one row or column are not combined).
// RowSlots (along rows): a mask of the per-row vector's slots to reduce; the others keep Op's identity (folded
// into init) without reading the tile. Blocks: only the tile's first Blocks 16-column blocks are read.
template <bool AlongRows, typename Op, register_tile RT, register_vector V, bool AcrossLanes = true,
          unsigned RowSlots = ~0u, int Blocks = RT::width>
__device__ __forceinline__ void reduce(V& out, const RT& t, const V* init) {
  using F = frag<typename RT::layout>;
  static_assert(AlongRows || Blocks == RT::width, "reduce: a column reduction reads every column block");
  static_assert(V::length == (AlongRows ? RT::rows : RT::cols) &&
                    V::per_lane == (AlongRows ? F::rows_per_lane : F::cols_per_lane),
                "reduction: the vector must be the tile's per_row (row_*) or per_col (col_*) type");
  float acc[V::blocks][V::per_lane];
#pragma unroll
  for (int b = 0; b < V::blocks; b++)
#pragma unroll
    for (int s = 0; s < V::per_lane; s++) acc[b][s] = Op::identity;
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int j = 0; j < Blocks; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 v = convert<float2>(t.data[i][j][k]);
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int b = AlongRows ? i : j, s = AlongRows ? F::row_slot(k, e) : F::col_slot(k, e);
          if (AlongRows && !((RowSlots >> s) & 1)) continue;
          acc[b][s] = Op::apply(acc[b][s], e ? v.y : v.x);
        }
      }
  constexpr int lo = AlongRows ? F::row_shuffle_lo : F::col_shuffle_lo;
  constexpr int hi = AlongRows ? F::row_shuffle_hi : F::col_shuffle_hi;
#pragma unroll
  for (int b = 0; b < V::blocks; b++)
#pragma unroll
    for (int s = 0; s < V::per_lane; s++) {
      if (AcrossLanes && (!AlongRows || ((RowSlots >> s) & 1)))
#pragma unroll
        for (int m = lo; m <= hi; m <<= 1) acc[b][s] = Op::apply(acc[b][s], __shfl_xor_sync(0xffffffffu, acc[b][s], m));
      const float folded = init ? Op::apply(convert<float>(init->data[b][s]), acc[b][s]) : acc[b][s];
      out.data[b][s] = convert<typename V::dtype>(folded);
    }
}

// dst = f(src, v) with v the vector entry of the element's row (AlongRows) or column. RowSlots (along rows): the
// row slots to apply f to; the other elements are copied.
template <bool AlongRows, register_tile D, register_tile S, register_vector V, typename F, unsigned RowSlots = ~0u>
__device__ __forceinline__ void broadcast(D& dst, const S& src, const V& v, F f) {
  using Fr = frag<typename S::layout>;
  auto live = [](int slot) { return !AlongRows || ((RowSlots >> slot) & 1); };
#pragma unroll
  for (int i = 0; i < S::height; i++)
#pragma unroll
    for (int j = 0; j < S::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        float2 x = convert<float2>(src.data[i][j][k]);
        const int b = AlongRows ? i : j;
        const int s0 = AlongRows ? Fr::row_slot(k, 0) : Fr::col_slot(k, 0);
        const int s1 = AlongRows ? Fr::row_slot(k, 1) : Fr::col_slot(k, 1);
        if (live(s0)) x.x = f(x.x, convert<float>(v.data[b][s0]));
        if (live(s1)) x.y = f(x.y, convert<float>(v.data[b][s1]));
        dst.data[i][j][k] = convert<typename D::T2>(x);
      }
}
}  // namespace detail

// Row reductions take an optional RowSlots: the per-row vector slots to reduce (e.g. 1: of a row-layout tile the
// rows lane / 4 of each 16-row block, i.e. its first 8 rows), the others left at the identity, folded into init.
#define TK_REDUCTION(name, along_rows, Op)                                                                        \
  template <unsigned RowSlots = ~0u, register_vector V, register_tile RT>                                         \
  __device__ __forceinline__ void name(V& out, const RT& t) {                                                     \
    detail::reduce<along_rows, Op, RT, V, true, RowSlots>(out, t, static_cast<const V*>(nullptr));                \
  }                                                                                                               \
  template <unsigned RowSlots = ~0u, register_vector V, register_tile RT>                                         \
  __device__ __forceinline__ void name(V& out, const RT& t, const V& init) {                                      \
    detail::reduce<along_rows, Op, RT, V, true, RowSlots>(out, t, &init);                                         \
  }
TK_REDUCTION(row_max, true, op::max)
TK_REDUCTION(row_min, true, op::min)
TK_REDUCTION(row_sum, true, op::add)
TK_REDUCTION(col_max, false, op::max)
TK_REDUCTION(col_min, false, op::min)
TK_REDUCTION(col_sum, false, op::add)
#undef TK_REDUCTION

// Row sums in shares: each lane adds only its own columns of each row (folded into its share in init), no
// exchange between the lanes that hold a row. A running sum kept this way (online softmax's) is combined
// once, by lanes_row_sum, instead of at every tile.
template <unsigned RowSlots = ~0u, register_vector V, register_tile RT>
__device__ __forceinline__ void row_sum_share(V& out, const RT& t, const V& init) {
  detail::reduce<true, op::add, RT, V, false, RowSlots>(out, t, &init);
}
// The row max over the tile's first Blocks 16-column blocks only (e.g. a first guess at it), folded into init.
template <int Blocks, unsigned RowSlots = ~0u, register_vector V, register_tile RT>
__device__ __forceinline__ void row_max_leading(V& out, const RT& t, const V& init) {
  static_assert(Blocks >= 1 && Blocks <= RT::width, "row_max_leading: 1 .. width blocks");
  detail::reduce<true, op::max, RT, V, true, RowSlots, Blocks>(out, t, &init);
}
// out = the full row sums from the lanes' shares in v, for vectors of tiles shaped like RT.
template <register_tile RT, register_vector V> __device__ __forceinline__ void lanes_row_sum(V& out, const V& v) {
  using F = frag<typename RT::layout>;
#pragma unroll
  for (int b = 0; b < V::blocks; b++)
#pragma unroll
    for (int s = 0; s < V::per_lane; s++) {
      float x = convert<float>(v.data[b][s]);
#pragma unroll
      for (int m = F::row_shuffle_lo; m <= F::row_shuffle_hi; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
      out.data[b][s] = convert<typename V::dtype>(x);
    }
}

// dst = f(src, v[row]) / f(src, v[col]): any fused per-row or per-column update in one pass.
template <unsigned RowSlots = ~0u, register_tile D, register_tile S, register_vector V, typename F>
__device__ __forceinline__ void map_row(D& dst, const S& src, const V& v, F f) {
  detail::broadcast<true, D, S, V, F, RowSlots>(dst, src, v, f);
}
template <register_tile D, register_tile S, register_vector V, typename F>
__device__ __forceinline__ void map_col(D& dst, const S& src, const V& v, F f) { detail::broadcast<false>(dst, src, v, f); }

#define TK_BROADCAST(name, along_rows, expr)                                                          \
  template <register_tile D, register_tile S, register_vector V>                                      \
  __device__ __forceinline__ void name(D& dst, const S& src, const V& v) {                            \
    detail::broadcast<along_rows>(dst, src, v, [](float x, float y) { return expr; });                \
  }
TK_BROADCAST(add_row, true, x + y)
TK_BROADCAST(sub_row, true, x - y)
TK_BROADCAST(mul_row, true, x * y)
TK_BROADCAST(div_row, true, x / y)
TK_BROADCAST(add_col, false, x + y)
TK_BROADCAST(sub_col, false, x - y)
TK_BROADCAST(mul_col, false, x * y)
TK_BROADCAST(div_col, false, x / y)
#undef TK_BROADCAST

// ---- masks -------------------------------------------------------------------------------------------
// dst = keep(row, col) ? src : fill, with (row, col) the element's position inside this warp's tile
// offset by (row0, col0) (for example the tile's place in the full attention matrix).
template <register_tile D, typename Keep>
__device__ __forceinline__ void mask(D& dst, const D& src, int row0, int col0, Keep keep, float fill_value) {
  using F = frag<typename D::layout>;
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        float2 x = convert<float2>(src.data[i][j][k]);
        const int r0 = row0 + 16 * i, c0 = col0 + 16 * j;
        if (!keep(r0 + F::row(k, 0), c0 + F::col(k, 0))) x.x = fill_value;
        if (!keep(r0 + F::row(k, 1), c0 + F::col(k, 1))) x.y = fill_value;
        dst.data[i][j][k] = convert<typename D::T2>(x);
      }
}
// dst = src where the element's column lies in its row's kept interval, fill_value elsewhere: for masks that
// keep an interval of each row (causal, windows, a sequence's end). range(row, lo, hi) gives the interval
// [lo, hi] of a row (positions offset by (row0, col0) as in mask), once a row; each element is then compared
// against a compile-time offset from its lane's first column, where mask evaluates keep per element.
// Lower = false: the intervals have no lower end inside the tile (lo <= col0 on every row; range's lo is ignored),
// so each element is compared with hi only.
template <unsigned RowSlots = ~0u, bool Lower = true, register_tile D, typename Range>
__device__ __forceinline__ void mask_cols(D& dst, const D& src, int row0, int col0, Range range, float fill_value) {
  static_assert(std::is_same_v<typename D::layout, row_l>, "row-layout tiles (a lane holds pairs of a row)");
  using F = frag<row_l>;
  const int lane_col = col0 + F::col(0, 0);
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int half = 0; half < 2; half++) {  // fragment values k = half, half + 2 hold row lane / 4 (+ 8)
      if (!((RowSlots >> half) & 1)) {  // a row slot left out: copied
#pragma unroll
        for (int j = 0; j < D::width; j++) {
          dst.data[i][j][half] = src.data[i][j][half];
          dst.data[i][j][half + 2] = src.data[i][j][half + 2];
        }
        continue;
      }
      int lo, hi;
      range(row0 + 16 * i + F::row(half, 0), lo, hi);
      lo -= lane_col;
      hi -= lane_col;
#pragma unroll
      for (int j = 0; j < D::width; j++)
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
          const int k = half + 2 * kk, c = 16 * j + 8 * kk;  // the lane's first column of the pair, less lane_col
          float2 x = convert<float2>(src.data[i][j][k]);
          if ((Lower && c < lo) || c > hi) x.x = fill_value;
          if ((Lower && c + 1 < lo) || c + 1 > hi) x.y = fill_value;
          dst.data[i][j][k] = convert<typename D::T2>(x);
        }
    }
}
// Lower triangle (col - row <= diagonal) kept, the rest set to fill_value: the causal mask.
template <register_tile D>
__device__ __forceinline__ void tril(D& dst, const D& src, int row0, int col0, int diagonal, float fill_value) {
  mask(dst, src, row0, col0, [diagonal](int r, int c) { return c - r <= diagonal; }, fill_value);
}
// Upper triangle (col - row >= diagonal) kept.
template <register_tile D>
__device__ __forceinline__ void triu(D& dst, const D& src, int row0, int col0, int diagonal, float fill_value) {
  mask(dst, src, row0, col0, [diagonal](int r, int c) { return c - r >= diagonal; }, fill_value);
}

// ---- relabelling and single rows / columns ----------------------------------------------------------
// The transpose of a register tile is the same registers read in the other layout (free): a row-layout
// R x C tile holds exactly what a column-layout C x R tile of its transpose holds, fragment (i, j) <-> (j, i).
template <register_tile RT>
__device__ __forceinline__ auto transpose(const RT& t) {
  using L = std::conditional_t<std::is_same_v<typename RT::layout, row_l>, col_l, row_l>;
  rt<typename RT::dtype, RT::cols, RT::rows, L> out;
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int j = 0; j < RT::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) out.data[j][i][k] = t.data[i][j][k];
  return out;
}

// v = row r of a row-layout tile, as a per-column vector in every lane (r warp-uniform, shuffles only).
template <register_vector V, row_register_tile RT>
__device__ __forceinline__ void row_of(V& v, const RT& t, int r) {
  static_assert(V::length == RT::cols && V::per_lane == frag<row_l>::cols_per_lane,
                "row_of: the vector must be the tile's per_col type");
  const int src = (r % 8) * 4 + (laneid() & 3), half = (r % 16) / 8;
#pragma unroll
  for (int j = 0; j < RT::width; j++)
#pragma unroll
    for (int s = 0; s < 4; s++) {  // slot s = 2 * (k >> 1) + e: columns 2q + 8(k >> 1) + e
      const int k_top = 2 * (s >> 1);
      float mine = 0.f;
#pragma unroll
      for (int i = 0; i < RT::height; i++) {  // selects, not a runtime index (which would go to local memory)
        const float2 lo = convert<float2>(t.data[i][j][k_top]), hi = convert<float2>(t.data[i][j][k_top + 1]);
        if (i == r / 16) mine = half ? (s & 1 ? hi.y : hi.x) : (s & 1 ? lo.y : lo.x);
      }
      v.data[j][s] = convert<typename V::dtype>(__shfl_sync(0xffffffffu, mine, src));
    }
}

// v = column c of a row-layout tile, as a per-row vector in every lane (c warp-uniform, shuffles only).
template <register_vector V, row_register_tile RT>
__device__ __forceinline__ void col_of(V& v, const RT& t, int c) {
  static_assert(V::length == RT::rows && V::per_lane == frag<row_l>::rows_per_lane,
                "col_of: the vector must be the tile's per_row type");
  const int src = (laneid() & ~3) | ((c % 8) / 2), hi = (c % 16) / 8, e = c % 2;
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int s = 0; s < 2; s++) {  // slot s = k & 1: rows g + 8s
      float mine = 0.f;
#pragma unroll
      for (int j = 0; j < RT::width; j++) {  // selects, not a runtime index
        const float2 lo = convert<float2>(t.data[i][j][s]), up = convert<float2>(t.data[i][j][2 + s]);
        if (j == c / 16) mine = hi ? (e ? up.y : up.x) : (e ? lo.y : lo.x);
      }
      v.data[i][s] = convert<typename V::dtype>(__shfl_sync(0xffffffffu, mine, src));
    }
}

// Columns [j*SC, (j+1)*SC) of a register tile (a register copy the compiler elides).
template <int SC, register_tile RT>
__device__ __forceinline__ rt<typename RT::dtype, RT::rows, SC, typename RT::layout> col_block(const RT& t, int j) {
  static_assert(SC % 16 == 0 && RT::cols % SC == 0, "col_block: whole fragments that divide the tile");
  rt<typename RT::dtype, RT::rows, SC, typename RT::layout> out;
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int jj = 0; jj < SC / 16; jj++)
#pragma unroll
      for (int k = 0; k < 4; k++) out.data[i][jj][k] = t.data[i][j * (SC / 16) + jj][k];
  return out;
}

// Columns [j*SC, (j+1)*SC) of a register tile set from `block` (the inverse of col_block).
template <int SC, register_tile RT, register_tile B>
__device__ __forceinline__ void set_col_block(RT& t, int j, const B& block) {
  static_assert(B::cols == SC && B::rows == RT::rows && RT::cols % SC == 0 &&
                    std::is_same_v<typename B::layout, typename RT::layout>,
                "set_col_block: a block of whole fragments with the tile's rows and layout");
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int jj = 0; jj < SC / 16; jj++)
#pragma unroll
      for (int k = 0; k < 4; k++) t.data[i][j * (SC / 16) + jj][k] = recast<typename RT::T2>(block.data[i][jj][k]);
}

}  // namespace kittens
