// Argument checks shared by the bindings: every op rejects bad input before any launch.
#pragma once
#include <cuda_runtime_api.h>
#include <torch/library.h>
#include <array>
#include <optional>
#include <string>
#include "../kernels/attention.h"
#include "../kernels/attention/variants.cuh"

namespace tk::checks {

// A tensor's shape as "[a, b, ...]", built by hand: the one check that printed t->sizes() into its message
// (v_descale's) killed the H200 host's interpreter (SIGSEGV) instead of raising, and k_descale's dtype check beside
// it raised; the cause is not known (docs/findings/serving.md#fp8-binding-segv).
inline std::string shape(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); i++) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}
inline std::string shape(const at::Tensor& t) { return shape(t.sizes()); }
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
inline int64_t attention_tile_dim(int64_t d) { return tk::attn::tile_head_dim(int(d)); }
// Attention sinks: float32 [hq] on q's device, one logit per query head; at the tile head dims only.
inline const float* attention_sinks(const std::optional<at::Tensor>& sinks, const at::Tensor& q, int64_t hq,
                                    int64_t d) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat, "sinks must be float32, got ", sinks->scalar_type());
  same_device(*sinks, q, "sinks", "q");
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == hq && sinks->is_contiguous(),
              "sinks must be a contiguous [q_heads] = [", hq, "] tensor, got shape ", shape(*sinks));
  TORCH_CHECK(attention_tile_dim(d) == d, "attention sinks need head dim 64, 128 or 256, got ", d);
  return sinks->data_ptr<float>();
}

// FP8 (e4m3) KV caches: float8_e4m3fn, or uint8 holding its bytes (vLLM allocates either). e5m2 is refused.
inline bool fp8_cache(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() != at::kFloat8_e5m2, name,
              " is float8_e5m2: e5m2 KV caches are not supported (FA3 refuses them too); use float8_e4m3fn");
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kByte;
}
// The caches k and v: q's dtype and device, or (returns true) both e4m3 of one dtype on q's device, at a head dim
// whose rows TMA can copy (a multiple of 16 bytes).
inline bool kv_caches(const at::Tensor& k, const at::Tensor& v, const at::Tensor& q, const char* k_name,
                      const char* v_name) {
  const bool fp8 = fp8_cache(k, k_name);
  if (!fp8) {
    like(k, q, k_name, "q");
    like(v, q, v_name, "q");
    return false;
  }
  fp8_cache(v, v_name);
  like(v, k, v_name, k_name);
  same_device(k, q, k_name, "q");
  TORCH_CHECK(k.size(-1) % 16 == 0, "fp8 caches need a head dim that is a multiple of 16, got ", k.size(-1));
  return true;
}
// A descale of an fp8 cache: null (1), or float32 [batch, kv_heads] on q's device at any strides (a per-tensor
// scale expanded has strides 0); strides out in elements.
inline const float* descale(const std::optional<at::Tensor>& t, const at::Tensor& q, int64_t batch, int64_t hkv,
                            const char* name, long* strides) {
  strides[0] = strides[1] = 0;
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
  same_device(*t, q, name, "q");
  TORCH_CHECK(t->dim() == 2 && t->size(0) == batch && t->size(1) == hkv, name, " must be [batch, kv_heads] = [", batch,
              ", ", hkv, "], got shape ", shape(*t));
  strides[0] = t->stride(0), strides[1] = t->stride(1);
  return t->data_ptr<float>();
}
// An fp8 cache's three descales (q's, k's and v's; descale's rules for each).
inline tk::attn_kv_descales kv_descales(const std::optional<at::Tensor>& q_descale,
                                        const std::optional<at::Tensor>& k_descale,
                                        const std::optional<at::Tensor>& v_descale, const at::Tensor& q,
                                        int64_t batch, int64_t hkv) {
  tk::attn_kv_descales d{};
  d.q = descale(q_descale, q, batch, hkv, "q_descale", d.q_strides);
  d.k = descale(k_descale, q, batch, hkv, "k_descale", d.k_strides);
  d.v = descale(v_descale, q, batch, hkv, "v_descale", d.v_strides);
  return d;
}
// Descales are for fp8 caches only (16-bit caches hold the values themselves).
inline void no_descales(const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
                        const std::optional<at::Tensor>& v, const at::Tensor& cache, const char* cache_name) {
  TORCH_CHECK(!q.has_value() && !k.has_value() && !v.has_value(),
              "q_descale / k_descale / v_descale apply to fp8 caches only, got ", cache_name, " of dtype ",
              cache.scalar_type());
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
