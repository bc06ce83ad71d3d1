// Global views: a (batch, depth, rows, cols) window onto device memory with compile-time or run-time
// sizes and run-time strides, carrying one TMA descriptor per shared-tile shape it will be copied with.
// Pass a struct of gl's to a kernel as `const __grid_constant__`, so the descriptors live in parameter
// space where TMA can read them.
#pragma once
#include <cuda.h>  // CUtensorMap and its enums (types only: nothing links -lcuda)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <array>
#include <stdexcept>
#include <string>
#include "../core/errors.cuh"
#include "st.cuh"

namespace kittens {

inline constexpr int RUNTIME = -1;  // a size given at run time

struct coord {  // element coordinates into a gl
  int b = 0, d = 0, row = 0, col = 0;
};

namespace detail {
template <typename T> constexpr CUtensorMapDataType tma_dtype() {
  if constexpr (std::is_same_v<T, bf16>) return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  else if constexpr (std::is_same_v<T, half>) return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  else if constexpr (std::is_same_v<T, fp8e4m3>) return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // bytes: TMA only copies them
  else return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}
constexpr CUtensorMapSwizzle tma_swizzle(int bytes) {
  return bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point, looked up once.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    TK_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      throw std::runtime_error("cuTensorMapEncodeTiled is not available from this CUDA driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// Box = one swizzle chunk of the tile: (chunk_cols, rows, 1, 1). Wider tiles are copied chunk by chunk,
// so ragged column extents are bounds-checked (zero-filled / clipped) by the hardware.
template <typename T, typename Tile>
inline CUtensorMap encode_tma(const T* ptr, const std::array<long, 4>& sizes, const std::array<long, 4>& strides,
                              CUtensorMapL2promotion promotion) {
  using R = typename Tile::ref_t;
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) throw std::invalid_argument("TMA needs a 16-byte aligned base address");
  // sizes/strides are (b, d, row, col); the tensor map wants innermost first.
  cuuint64_t dims[4] = {cuuint64_t(sizes[3]), cuuint64_t(sizes[2]), cuuint64_t(sizes[1]), cuuint64_t(sizes[0])};
  cuuint64_t gstrides[3];
  long prev = sizes[3] * long(sizeof(T));
  for (int i = 0; i < 3; i++) {
    long size = sizes[2 - i], stride = strides[2 - i] * long(sizeof(T));
    if (size == 1) stride = (prev + 15) / 16 * 16;  // never stepped: any legal value
    if (stride % 16 != 0)
      throw std::invalid_argument("TMA needs every non-unit stride to be a multiple of 16 bytes, got " +
                                  std::to_string(stride) + " bytes");
    gstrides[i] = cuuint64_t(stride);
    prev = stride * size;
  }
  if (strides[3] != 1) throw std::invalid_argument("TMA needs the innermost dimension to be contiguous");
  cuuint32_t box[4] = {cuuint32_t(R::chunk_cols), cuuint32_t(R::rows), 1, 1};
  cuuint32_t estrides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  CUresult res = tensor_map_encoder()(&map, tma_dtype<T>(), 4, const_cast<T*>(ptr), dims, gstrides, box, estrides,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, tma_swizzle(R::swizzle_bytes),
                                      promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) throw std::runtime_error("cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(res)));
  return map;
}

template <typename Want, typename... Tiles> consteval int tile_index() {
  using W = typename Want::ref_t;
  constexpr bool match[] = {(Tiles::ref_t::rows == W::rows && Tiles::ref_t::swizzle_bytes == W::swizzle_bytes &&
                             std::is_same_v<typename Tiles::dtype, typename W::dtype>)...};
  for (int i = 0; i < int(sizeof...(Tiles)); i++)
    if (match[i]) return i;
  return -1;
}
}  // namespace detail

template <storage_element T, int B = RUNTIME, int D = RUNTIME, int R = RUNTIME, int C = RUNTIME, typename... Tiles>
struct gl {
  using dtype = T;
  __host__ __device__ static constexpr int static_size(int i) { return i == 0 ? B : i == 1 ? D : i == 2 ? R : C; }

  T* ptr;
  long sizes[4];    // b, d, row, col
  long strides[4];  // in elements
  CUtensorMap maps[sizeof...(Tiles) > 0 ? sizeof...(Tiles) : 1];

  gl() = default;
  // Host: sizes (b, d, row, col) and strides in elements; strides default to contiguous. `promotion`: the L2 fill
  // a TMA read of these rows asks for (256 B by default: a 128-B box's neighbour comes along).
  __host__ gl(T* p, std::array<long, 4> size, std::array<long, 4> stride = {0, 0, 0, 0},
              CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) : ptr(p) {
    for (int i = 0; i < 4; i++) {
      if (static_size(i) != RUNTIME && static_size(i) != size[i])
        throw std::invalid_argument("gl: dimension " + std::to_string(i) + " is fixed at " +
                                    std::to_string(static_size(i)) + " but got " + std::to_string(size[i]));
      sizes[i] = size[i];
    }
    if (stride == std::array<long, 4>{0, 0, 0, 0}) stride = {size[1] * size[2] * size[3], size[2] * size[3], size[3], 1};
    for (int i = 0; i < 4; i++) strides[i] = stride[i];
    int i = 0;
    ((maps[i++] = detail::encode_tma<T, Tiles>(p, size, stride, promotion)), ...);
  }

  __device__ __forceinline__ long size(int i) const { return static_size(i) != RUNTIME ? static_size(i) : sizes[i]; }
  __device__ __forceinline__ long rows() const { return size(2); }
  __device__ __forceinline__ long cols() const { return size(3); }
  __device__ __forceinline__ T* at(coord c) const {
    return ptr + c.b * strides[0] + c.d * strides[1] + long(c.row) * strides[2] + c.col;
  }
  // The descriptor for copies into / out of tiles shaped like Tile (matched on rows, swizzle, dtype).
  template <typename Tile> __device__ __forceinline__ const CUtensorMap* tma() const {
    constexpr int idx = detail::tile_index<Tile, Tiles...>();
    static_assert(idx >= 0, "this gl carries no TMA descriptor for that tile shape: add it to the gl's tile list");
    return &maps[idx];
  }
};

}  // namespace kittens
