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
// page held: e4m3 NaNs give NaN in P V even where P is 0), by THREADS threads of the caller (`thread` each).
// A thread keeps its positions in an 8-row swizzle atom for the whole tile: the swizzle repeats every 8 rows, so its
// units lie a whole atom's bytes apart, and their addresses are one computed address plus constants (a unit's
// address worked out from its index cost ~70 instructions a unit, which made the conversion the kernel's bottleneck).
template <int THREADS, typename Dst, typename Src>
__device__ __forceinline__ void dequantize(const Dst& dst_tile, const Src& src_tile, int valid_rows, int thread) {
  const auto dst = as_ref(dst_tile);
  const auto src = as_ref(src_tile);
  using D = decltype(dst);
  using S = decltype(src);
  static_assert(std::is_same_v<typename S::dtype, fp8e4m3> && std::is_same_v<typename D::dtype, half>,
                "dequantize: an fp8e4m3 tile into an fp16 one");
  static_assert(S::rows == D::rows && S::cols == D::cols, "dequantize: both tiles have the same shape");
  constexpr int U = S::cols / 16, ATOM = 8 * U, ATOMS = S::rows / 8;  // units a row, an atom; atoms a tile
  // The threads that work: whole atoms' worth of them (each a position in one atom of every ATOM_STEP-th), or, for
  // atoms wider than THREADS, 64 of them with ATOM / 64 positions in every atom.
  constexpr bool whole = ATOM <= THREADS;
  constexpr int USED = whole ? THREADS / ATOM * ATOM : 64, PER_ATOM = whole ? 1 : ATOM / USED;
  constexpr int ATOM_STEP = whole ? USED / ATOM : 1, TRIPS = (ATOMS + ATOM_STEP - 1) / ATOM_STEP;
  static_assert(whole || ATOM % USED == 0, "dequantize: atoms split evenly over the threads");
  constexpr uint32_t src_atom = 8 * S::swizzle_bytes, dst_atom = 8 * D::swizzle_bytes;  // bytes an atom
  if (thread >= USED) return;
  const int first = whole ? thread / ATOM : 0;
  const auto run = [&](auto check_rows) {
#pragma unroll
    for (int j = 0; j < PER_ATOM; j++) {
      const int pos = whole ? thread % ATOM : thread + j * USED, r = pos / U, c = (pos % U) * 16;
      const uint32_t s0 = src.addr(r, c), d0 = dst.addr(r, c), d1 = dst.addr(r, c + 8);
      // Every load of a batch first (a store might alias a later load's address for all the compiler knows); at
      // most 8 in flight, which 96 registers hold (16, a 128-row tile's, spilled).
      constexpr int BATCH = TRIPS < 8 ? TRIPS : 8;
#pragma unroll
      for (int a0 = 0; a0 < TRIPS; a0 += BATCH) {
        uint4 x[BATCH];
#pragma unroll
        for (int a = a0; a < a0 + BATCH && a < TRIPS; a++)
          if (ATOMS % ATOM_STEP == 0 || first + a * ATOM_STEP < ATOMS)
            x[a - a0] = detail::ld_shared_16B<fp8e4m3>(s0 + (first + a * ATOM_STEP) * src_atom);
#pragma unroll
        for (int a = a0; a < a0 + BATCH && a < TRIPS; a++) {
          const int atom = first + a * ATOM_STEP;
          if (ATOMS % ATOM_STEP != 0 && atom >= ATOMS) break;
          uint4& u = x[a - a0];
          if (decltype(check_rows)::value && 8 * atom + r >= valid_rows) u = uint4{0, 0, 0, 0};
          const uint2 lo = e4m3x4_to_half(u.x), hi = e4m3x4_to_half(u.y);
          const uint2 lo2 = e4m3x4_to_half(u.z), hi2 = e4m3x4_to_half(u.w);
          detail::st_shared_16B(d0 + atom * dst_atom, uint4{lo.x, lo.y, hi.x, hi.y});
          detail::st_shared_16B(d1 + atom * dst_atom, uint4{lo2.x, lo2.y, hi2.x, hi2.y});
        }
      }
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
