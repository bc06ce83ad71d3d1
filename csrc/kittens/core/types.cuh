// Element types the DSL knows, and their packed (2-wide) forms.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace kittens {

using bf16 = __nv_bfloat16;
using half = __half;
using bf16_2 = __nv_bfloat162;
using half_2 = __half2;

template <typename T>
concept tensor_core_input = std::is_same_v<T, bf16> || std::is_same_v<T, half>;

template <typename T>
concept element = tensor_core_input<T> || std::is_same_v<T, float>;

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
