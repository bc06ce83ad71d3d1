// Prefill over an FP8 (e4m3) paged cache: the pages a varlen batch reads, dequantized into a 16-bit scratch cache of
// the same block layout (attention.h: fp8_pages_problem), on which the paged prefill kernel then runs unchanged.
// Prefill is compute-bound: one read of the fp8 pages and one write of 16-bit ones beside its products.
#include "../kittens/core/types.cuh"
#include "../kittens/core/errors.cuh"
#include <algorithm>
#include "attention.h"

namespace tk {
namespace {

using namespace kittens;

constexpr int PAGE_THREADS = 256;
constexpr long MAX_PAGE_BLOCKS = 8192;  // enough to fill any H100 / H200 several times over

__device__ __forceinline__ float descale_at(const float* x, const long* strides, int b, int h) {
  return x ? __ldg(x + b * strides[0] + h * strides[1]) : 1.f;
}

// 16 e4m3 values (a 16-byte unit) times `scale`, as two 16-byte units of T.
template <typename T>
__device__ __forceinline__ void dequantize_unit(const uint4& x, float scale, uint4& lo, uint4& hi) {
  const uint32_t in[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; i++) {
    fp8e4m3_2 pair;
    pair.__x = uint16_t(in[i / 2] >> (16 * (i % 2)));
    const float2 f = convert<float2>(convert<half_2>(pair));
    const packed<T> y = convert<packed<T>>(float2{f.x * scale, f.y * scale});
    out[i] = *reinterpret_cast<const uint32_t*>(&y);
  }
  lo = {out[0], out[1], out[2], out[3]};
  hi = {out[4], out[5], out[6], out[7]};
}

// Scratch slot `slot` of sequence b: its table page first + slot, K and V, if the sequence reaches it. Slot 0 also
// writes the scratch table's row b and the sequence's key count, clamped to the table (a caller's max_seqlen_k
// bounds it; past it nothing is read).
template <typename T>
__device__ void dequantize_page(const fp8_pages_problem& p, int b, int slot) {
  const int keys = p.seqused_k ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
  const int pages = min(max((keys + p.block_size - 1) / p.block_size, 0), p.max_pages);
  const int queries = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
  const int first = p.window_left >= 0 ? min(max(keys - queries - p.window_left, 0) / p.block_size, pages) : 0;
  const long base = long(b) * p.slots;
  if (slot == 0) {
    for (int j = threadIdx.x; j < p.max_pages; j += PAGE_THREADS)
      p.table_out[long(b) * p.max_pages + j] = int(base + min(max(j - first, 0), p.slots - 1));
    if (threadIdx.x == 0) p.seqused_out[b] = min(max(keys, 0), p.max_pages * p.block_size);
  }
  const int j = first + slot;
  if (j >= pages) return;
  const long page = __ldg(p.block_table + b * p.bt_stride + j);
  const int units_per_head = p.head_dim / 16, units = p.block_size * p.hkv * units_per_head;
#pragma unroll 1
  for (int kv = 0; kv < 2; kv++) {
    const uint8_t* src = static_cast<const uint8_t*>(kv ? p.v : p.k);
    const long* strides = kv ? p.v_strides : p.k_strides;
    T* dst = static_cast<T*>(kv ? p.v_out : p.k_out) + (base + slot) * p.block_size * p.hkv * p.head_dim;
    for (int u = threadIdx.x; u < units; u += PAGE_THREADS) {
      const int token = u / (p.hkv * units_per_head), h = u / units_per_head % p.hkv, c = u % units_per_head * 16;
      const float scale = kv ? descale_at(p.descales.v, p.descales.v_strides, b, h)
                             : descale_at(p.descales.k, p.descales.k_strides, b, h) *
                                   descale_at(p.descales.q, p.descales.q_strides, b, h);
      const uint4 x =
          __ldg(reinterpret_cast<const uint4*>(src + page * strides[0] + token * strides[1] + h * strides[2] + c));
      uint4 lo, hi;
      dequantize_unit<T>(x, scale, lo, hi);
      uint4* out = reinterpret_cast<uint4*>(dst + (long(token) * p.hkv + h) * p.head_dim + c);
      out[0] = lo;
      out[1] = hi;
    }
  }
}

// Each block takes the (sequence, slot) pairs blockIdx.x, + gridDim.x, ...: a grid of bounded size however many
// pages the batch reads.
template <typename T>
__global__ void __launch_bounds__(PAGE_THREADS) dequantize_pages(const fp8_pages_problem p) {
  const long pairs = long(p.batch) * p.slots;
  for (long i = blockIdx.x; i < pairs; i += gridDim.x) dequantize_page<T>(p, int(i / p.slots), int(i % p.slots));
}

}  // namespace

void fp8_pages_dequantize(const fp8_pages_problem& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  const int grid = int(std::min<long>(long(p.batch) * p.slots, MAX_PAGE_BLOCKS));
  if (p.type == dtype::bf16) dequantize_pages<bf16><<<grid, PAGE_THREADS, 0, stream>>>(p);
  else dequantize_pages<half><<<grid, PAGE_THREADS, 0, stream>>>(p);
  TK_LAUNCH_CHECK();
}

}  // namespace tk
