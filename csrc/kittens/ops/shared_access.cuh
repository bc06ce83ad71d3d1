// Raw shared-memory accesses by shared-window address (what swizzled tiles hand out).
#pragma once
#include "../core/types.cuh"

namespace kittens::detail {

template <typename T> __device__ __forceinline__ T ld_shared(uint32_t addr) {
  if constexpr (sizeof(T) == 2) {
    uint16_t v;
    asm volatile("ld.shared.b16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
    return *reinterpret_cast<T*>(&v);
  } else if constexpr (sizeof(T) == 4) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return *reinterpret_cast<T*>(&v);
  } else {
    static_assert(sizeof(T) == 8, "ld_shared: 2, 4 or 8 bytes");
    uint2 v;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return *reinterpret_cast<T*>(&v);
  }
}

template <typename T> __device__ __forceinline__ void st_shared(uint32_t addr, const T& x) {
  if constexpr (sizeof(T) == 2) {
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(*reinterpret_cast<const uint16_t*>(&x)) : "memory");
  } else if constexpr (sizeof(T) == 4) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(*reinterpret_cast<const uint32_t*>(&x)) : "memory");
  } else {
    static_assert(sizeof(T) == 8, "st_shared: 2, 4 or 8 bytes");
    const uint2 v = *reinterpret_cast<const uint2*>(&x);
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
  }
}

template <typename T> __device__ __forceinline__ uint4 ld_shared_16B(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_16B(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Four 8x8 16-bit matrices between shared memory and a warp's registers; lane l names row l % 8 of
// matrix l / 8. Without .trans lane t holds (row t / 4, cols 2(t % 4) + {0, 1}) of each matrix.
template <bool Transpose>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (Transpose)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
template <bool Transpose>
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  if constexpr (Transpose)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

}  // namespace kittens::detail
