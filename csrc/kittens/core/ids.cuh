// Thread-organisation constants and who-am-I helpers.
#pragma once

namespace kittens {

inline constexpr int WARP_THREADS = 32;
inline constexpr int WARPGROUP_WARPS = 4;
inline constexpr int WARPGROUP_THREADS = WARP_THREADS * WARPGROUP_WARPS;

__device__ __forceinline__ int laneid() { return threadIdx.x % WARP_THREADS; }
__device__ __forceinline__ int warpid() { return threadIdx.x / WARP_THREADS; }
__device__ __forceinline__ int warpgroupid() { return threadIdx.x / WARPGROUP_THREADS; }

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace kittens
