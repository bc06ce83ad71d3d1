// Argument checks shared by the bindings: every op rejects bad input before any launch.
#pragma once
#include <cuda_runtime_api.h>
#include <torch/library.h>
#include <array>
#include <optional>
#include <string>

namespace tk::checks {

inline void cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
}
inline void half_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, name,
              " must be bfloat16 or float16, got ", t.scalar_type());
}
inline void same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have the dtype of ", ref_name, " (",
              ref.scalar_type(), "), got ", t.scalar_type());
}
inline void same_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on ", ref_name, "'s device (", ref.device(), "), got ",
              t.device());
}
// Same dtype and device as `ref` (the tensor whose kind every other operand must follow).
inline void like(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  same_dtype(t, ref, name, ref_name);
  same_device(t, ref, name, ref_name);
}
inline void rank(const at::Tensor& t, int64_t r, const char* name) {
  TORCH_CHECK(t.dim() == r, name, " must have ", r, " dimensions, got ", t.dim());
}
// Row-major rows that TMA can address: unit inner stride, 16-byte aligned base and row stride.
inline void tma_rows(const at::Tensor& t, const char* name) {
  const int64_t esize = t.element_size();
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, name, " must have a contiguous last dimension, got stride ",
              t.stride(-1));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
  for (int64_t d = 0; d + 1 < t.dim(); d++)
    TORCH_CHECK(t.size(d) == 1 || (t.stride(d) * esize) % 16 == 0, name, " stride ", d, " (", t.stride(d),
                " elements) must be a multiple of 16 bytes");
}

// Attention head dims: any multiple of 8 up to 256 (those between 64, 128 and 256 run on the next tile up).
inline void attention_head_dim(int64_t d) {
  TORCH_CHECK(d % 8 == 0 && d >= 8 && d <= 256, "head dim must be a multiple of 8 between 8 and 256, got ", d);
}
inline int64_t attention_tile_dim(int64_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }
// Attention sinks: float32 [hq] on q's device, one logit per query head; at the tile head dims only.
inline const float* attention_sinks(const std::optional<at::Tensor>& sinks, const at::Tensor& q, int64_t hq,
                                    int64_t d) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat, "sinks must be float32, got ", sinks->scalar_type());
  same_device(*sinks, q, "sinks", "q");
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == hq && sinks->is_contiguous(),
              "sinks must be a contiguous [q_heads] = [", hq, "] tensor, got shape ", sinks->sizes());
  TORCH_CHECK(attention_tile_dim(d) == d, "attention sinks need head dim 64, 128 or 256, got ", d);
  return sinks->data_ptr<float>();
}

// Multiprocessors of `device`, read once per device (persistent grids size themselves from it).
inline int sm_count(int device) {
  static std::array<int, 64> cached{};
  if (device < 0 || device >= 64) device = 0;
  if (cached[device] == 0) {
    int n = 0;
    TORCH_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess,
                "could not read the multiprocessor count of cuda:", device);
    cached[device] = n;
  }
  return cached[device];
}

}  // namespace tk::checks
