// FP8 (e4m3) K/V tiles to the fp16 tiles the products read, on chip. Both tiles are read and written in 16-byte
// units through their swizzled addresses (16 e4m3 values of a row -> two units of fp16), so the fp16 tile is laid
// out as TMA would have written it and wgmma reads it. The caller publishes the result (the proxy fence and a
// hand-off) before a product reads it.
#pragma once
#include "../../kittens/kittens.cuh"

namespace tk::decode {

using namespace kittens;

// Four e4m3 values (a 32-bit word, the lowest byte first) as two fp16 pairs.
__device__ __forceinline__ uint2 e4m3x4_to_half(uint32_t x) {
  fp8e4m3_2 lo, hi;
  lo.__x = uint16_t(x);
  hi.__x = uint16_t(x >> 16);
  const half_2 a = convert<half_2>(lo), b = convert<half_2>(hi);
  return {*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b)};
}

// dst = src in fp16, rows at or past `valid_rows` zeroed (a tile's rows past a sequence's end hold whatever the
// page held: e4m3 NaNs give NaN in P V even where P is 0), by threads [0, threads) of the caller (`thread` each).
// Each thread reads up to four units before it converts and writes them, so the shared loads are in flight together.
template <typename Dst, typename Src>
__device__ __forceinline__ void dequantize(const Dst& dst_tile, const Src& src_tile, int valid_rows, int thread,
                                           int threads) {
  const auto dst = as_ref(dst_tile);
  const auto src = as_ref(src_tile);
  using D = decltype(dst);
  using S = decltype(src);
  static_assert(std::is_same_v<typename S::dtype, fp8e4m3> && std::is_same_v<typename D::dtype, half>,
                "dequantize: an fp8e4m3 tile into an fp16 one");
  static_assert(S::rows == D::rows && S::cols == D::cols, "dequantize: both tiles have the same shape");
  constexpr int units_per_row = S::cols / 16, units = S::rows * units_per_row, batch = 4;
#pragma unroll 1
  for (int u0 = thread; u0 < units; u0 += batch * threads) {
    uint4 x[batch];
#pragma unroll
    for (int i = 0; i < batch; i++) {
      const int u = u0 + i * threads;
      if (u < units) x[i] = detail::ld_shared_16B<fp8e4m3>(src.addr(u / units_per_row, (u % units_per_row) * 16));
    }
#pragma unroll
    for (int i = 0; i < batch; i++) {
      const int u = u0 + i * threads, r = u / units_per_row, c = (u % units_per_row) * 16;
      if (u >= units) break;
      if (r >= valid_rows) x[i] = uint4{0, 0, 0, 0};
      const uint2 a = e4m3x4_to_half(x[i].x), b = e4m3x4_to_half(x[i].y);
      const uint2 e = e4m3x4_to_half(x[i].z), f = e4m3x4_to_half(x[i].w);
      detail::st_shared_16B(dst.addr(r, c), uint4{a.x, a.y, b.x, b.y});
      detail::st_shared_16B(dst.addr(r, c + 8), uint4{e.x, e.y, f.x, f.y});
    }
  }
}

// Eight 16-bit values (a 16-byte unit) as fp16: queries of either type feed the fp16 products.
template <typename T>
__device__ __forceinline__ uint4 to_half_unit(uint4 x) {
  if constexpr (std::is_same_v<T, half>) {
    return x;
  } else {
    uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const half_2 h = recast<half_2>(*reinterpret_cast<const packed<T>*>(&w[i]));
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return {w[0], w[1], w[2], w[3]};
  }
}

}  // namespace tk::decode
