// Element types the DSL knows, and their packed (2-wide) forms.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <type_traits>

namespace kittens {

using bf16 = __nv_bfloat16;
using half = __half;
using bf16_2 = __nv_bfloat162;
using half_2 = __half2;
// float8_e4m3fn (FP8 KV caches): a storage type. Shared tiles and global views hold it and TMA copies it, but no
// register tile or product takes it: a kernel converts it to fp16 on chip first (every e4m3 value is exact in fp16).
using fp8e4m3 = __nv_fp8_e4m3;
using fp8e4m3_2 = __nv_fp8x2_e4m3;

template <typename T>
concept tensor_core_input = std::is_same_v<T, bf16> || std::is_same_v<T, half>;

template <typename T>
concept element = tensor_core_input<T> || std::is_same_v<T, float>;

// What shared tiles and global views may hold: the elements, and the storage-only fp8e4m3.
template <typename T>
concept storage_element = element<T> || std::is_same_v<T, fp8e4m3>;

// packed<T>: the 2-element register type fragments are made of.
template <typename T> struct packed_of;
template <> struct packed_of<float> { using type = float2; };
template <> struct packed_of<bf16> { using type = bf16_2; };
template <> struct packed_of<half> { using type = half_2; };
template <typename T> using packed = typename packed_of<T>::type;

// Conversions between element types (scalar and packed), all destination-first in the ops layer.
template <typename To, typename From> __device__ __forceinline__ To convert(From x);
template <> __device__ __forceinline__ float convert<float, float>(float x) { return x; }
template <> __device__ __forceinline__ float convert<float, bf16>(bf16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float convert<float, half>(half x) { return __half2float(x); }
template <> __device__ __forceinline__ bf16 convert<bf16, float>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ half convert<half, float>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ bf16 convert<bf16, bf16>(bf16 x) { return x; }
template <> __device__ __forceinline__ half convert<half, half>(half x) { return x; }
template <> __device__ __forceinline__ float2 convert<float2, float2>(float2 x) { return x; }
template <> __device__ __forceinline__ float2 convert<float2, bf16_2>(bf16_2 x) { return __bfloat1622float2(x); }
template <> __device__ __forceinline__ float2 convert<float2, half_2>(half_2 x) { return __half22float2(x); }
template <> __device__ __forceinline__ bf16_2 convert<bf16_2, float2>(float2 x) { return __float22bfloat162_rn(x); }
template <> __device__ __forceinline__ half_2 convert<half_2, float2>(float2 x) { return __float22half2_rn(x); }
template <> __device__ __forceinline__ bf16_2 convert<bf16_2, bf16_2>(bf16_2 x) { return x; }
template <> __device__ __forceinline__ half_2 convert<half_2, half_2>(half_2 x) { return x; }
// e4m3 pair to fp16 pair, exactly: one instruction on sm_89+ (F2FP.F16.E4M3.UNPACK_B).
template <> __device__ __forceinline__ half_2 convert<half_2, fp8e4m3_2>(fp8e4m3_2 x) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(x.__x));
  return *reinterpret_cast<half_2*>(&h);
}

// Packed pair to packed pair: free when the types match, else through fp32.
template <typename To, typename From> __device__ __forceinline__ To recast(From x) {
  if constexpr (std::is_same_v<To, From>) return x;
  else if constexpr (std::is_same_v<From, float2>) return convert<To>(x);
  else return convert<To>(convert<float2>(x));
}

// The PTX spelling of a tensor-core input type, for instruction strings.
template <tensor_core_input T> struct ptx_name;
template <> struct ptx_name<bf16> { static constexpr const char* value = "bf16"; };
template <> struct ptx_name<half> { static constexpr const char* value = "f16"; };

}  // namespace kittens
