// Integer division by a runtime divisor that is fixed for a launch (a head count, a grid size): the multiplier
// is worked out once on the host, and n / d is then one 32 x 32 -> 64-bit multiply and a shift on the device,
// where the compiler's division is ~20 dependent instructions through the special-function unit (~150 cycles).
#pragma once
#include <cstdint>

namespace kittens {

// Exact for 0 <= n < 2^31 and 1 <= d < 2^31. With c = ceil(log2 d) and mul = ceil(2^(31 + c) / d) (< 2^32),
// n * mul / 2^(31 + c) = n / d + err with 0 <= err < n / 2^(31 + c) < 2^-c <= 1 / d, so the floor is n / d's.
struct divisor {
  int d = 1;
  uint32_t mul = 1u << 31;
  int shift = 31;

  divisor() = default;
  __host__ __device__ explicit divisor(int d_) : d(d_) {
    int c = 0;
    while ((int64_t(1) << c) < d) c++;
    shift = 31 + c;
    mul = uint32_t(((uint64_t(1) << shift) + uint64_t(d) - 1) / uint64_t(d));
  }
  __host__ __device__ __forceinline__ int div(int n) const { return int((uint64_t(uint32_t(n)) * mul) >> shift); }
  __host__ __device__ __forceinline__ int mod(int n) const { return n - div(n) * d; }
};

}  // namespace kittens
