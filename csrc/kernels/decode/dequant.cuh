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
// page held: e4m3 NaNs give NaN in P V even where P is 0), by WARPS warps of the caller (`warp` each).
// A warp converts a slice of 32 units (16 e4m3 values each) at a time, slices WARPS apart. The swizzle repeats
// every 8 rows, so a lane's unit in slice h lies at one of PHASES addresses worked out once plus h's whole atoms:
// no per-unit address arithmetic (working each unit's address out from its index cost ~70 instructions a unit).
// Every warp of the caller's warps takes part: F2FP issues at a quarter rate, so a warp a sub-partition counts.
template <int WARPS, typename Dst, typename Src>
__device__ __forceinline__ void dequantize(const Dst& dst_tile, const Src& src_tile, int valid_rows, int warp,
                                           int lane) {
  const auto dst = as_ref(dst_tile);
  const auto src = as_ref(src_tile);
  using D = decltype(dst);
  using S = decltype(src);
  static_assert(std::is_same_v<typename S::dtype, fp8e4m3> && std::is_same_v<typename D::dtype, half>,
                "dequantize: an fp8e4m3 tile into an fp16 one");
  static_assert(S::rows == D::rows && S::cols == D::cols, "dequantize: both tiles have the same shape");
  constexpr int U = S::cols / 16, SLICE_ROWS = WARP_THREADS / U, PHASES = 8 / SLICE_ROWS;
  static_assert(WARP_THREADS % U == 0 && SLICE_ROWS <= 8 && 8 % SLICE_ROWS == 0 && S::rows % SLICE_ROWS == 0,
                "dequantize: a warp's slice is whole rows within one 8-row swizzle atom");
  constexpr int SLICES = S::rows / SLICE_ROWS, TRIPS = (SLICES + WARPS - 1) / WARPS;
  constexpr uint32_t src_atom = 8 * S::swizzle_bytes, dst_atom = 8 * D::swizzle_bytes;  // bytes an atom
  const int lane_row = lane / U, c = (lane % U) * 16;
  // k: the phase of this warp's slices warp + k (mod PHASES), i.e. of its trips i with WARPS * i = k (mod PHASES)
  uint32_t s0[PHASES], d0[PHASES], d1[PHASES];
#pragma unroll
  for (int k = 0; k < PHASES; k++) {
    const int r = (warp + k) % PHASES * SLICE_ROWS + lane_row;
    s0[k] = src.addr(r, c), d0[k] = dst.addr(r, c), d1[k] = dst.addr(r, c + 8);
  }
  const auto run = [&](auto check_rows) {
    uint4 x[TRIPS];  // every load first: a store might alias a later load's address for all the compiler knows
#pragma unroll
    for (int i = 0; i < TRIPS; i++) {
      const int h = warp + WARPS * i;
      if (SLICES % WARPS == 0 || h < SLICES)
        x[i] = detail::ld_shared_16B<fp8e4m3>(s0[WARPS * i % PHASES] + uint32_t(h / PHASES) * src_atom);
    }
#pragma unroll
    for (int i = 0; i < TRIPS; i++) {
      const int h = warp + WARPS * i;
      if (SLICES % WARPS != 0 && h >= SLICES) break;
      if (decltype(check_rows)::value && h * SLICE_ROWS + lane_row >= valid_rows) x[i] = uint4{0, 0, 0, 0};
      const uint2 lo = e4m3x4_to_half(x[i].x), hi = e4m3x4_to_half(x[i].y);
      const uint2 lo2 = e4m3x4_to_half(x[i].z), hi2 = e4m3x4_to_half(x[i].w);
      const uint32_t at = uint32_t(h / PHASES) * dst_atom;
      detail::st_shared_16B(d0[WARPS * i % PHASES] + at, uint4{lo.x, lo.y, hi.x, hi.y});
      detail::st_shared_16B(d1[WARPS * i % PHASES] + at, uint4{lo2.x, lo2.y, hi2.x, hi2.y});
    }
  };
  if (valid_rows >= S::rows) run(std::false_type{});
  else run(std::true_type{});
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
