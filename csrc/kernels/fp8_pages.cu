// Prefill over an FP8 (e4m3) paged cache: the pages a varlen batch reads, dequantized into an fp16 scratch cache of
// the same block layout (attention.h: fp8_pages_problem), on which the paged prefill kernel then runs unchanged.
// fp16, not q's bf16: a scaled e4m3 value rounds to 11 bits there, and at 8 bits the scores' rounding alone moved
// outputs by 0.03 (docs/findings/decode.md: fp8-prefill-scratch). Prefill is compute-bound: one read of the fp8
// pages and one write of fp16 ones beside its products.
#include "../kittens/core/types.cuh"
#include "../kittens/core/errors.cuh"
#include <algorithm>
#include "attention.h"

namespace tk {
namespace {

using namespace kittens;

constexpr int PAGE_THREADS = 256;
constexpr int PLAN_THREADS = 1024;
constexpr long MAX_PAGE_BLOCKS = 8192;  // enough to fill any H100 / H200 several times over
constexpr float HALF_MAX = 65504.f;

__device__ __forceinline__ float descale_at(const float* x, const long* strides, int b, int h) {
  return x ? __ldg(x + b * strides[0] + h * strides[1]) : 1.f;
}

// 16 e4m3 values (a 16-byte unit) times `scale`, saturated to fp16's range, as two 16-byte units of fp16.
__device__ __forceinline__ void dequantize_unit(const uint4& x, float scale, uint4& lo, uint4& hi) {
  const uint32_t in[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; i++) {
    fp8e4m3_2 pair;
    pair.__x = uint16_t(in[i / 2] >> (16 * (i % 2)));
    const float2 f = convert<float2>(convert<half_2>(pair));
    const half_2 y = convert<half_2>(float2{fminf(fmaxf(f.x * scale, -HALF_MAX), HALF_MAX),
                                            fminf(fmaxf(f.y * scale, -HALF_MAX), HALF_MAX)});
    out[i] = *reinterpret_cast<const uint32_t*>(&y);
  }
  lo = {out[0], out[1], out[2], out[3]};
  hi = {out[4], out[5], out[6], out[7]};
}

// Sequence b's keys and the table pages [first, pages) it reads.
struct seq_pages {
  int keys, first, pages;
};

__device__ __forceinline__ seq_pages pages_of(const fp8_pages_problem& p, int b) {
  const int keys = p.seqused_k ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
  const int pages = min(max((keys + p.block_size - 1) / p.block_size, 0), p.max_pages);
  const int queries = max(p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b], 0);
  const int first = p.window_left >= 0 ? min(max(keys - queries - p.window_left, 0) / p.block_size, pages) : 0;
  return {keys, first, pages};
}

// offsets[b]: sequence b's first scratch page (the pages of the sequences before it, packed); one block.
__global__ void __launch_bounds__(PLAN_THREADS) plan_pages(const fp8_pages_problem p) {
  __shared__ int warp_sums[PLAN_THREADS / 32];
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int base = 0; base < p.batch; base += PLAN_THREADS) {
    __syncthreads();
    const int b = base + threadIdx.x;
    int n = 0;
    if (b < p.batch) {
      const seq_pages s = pages_of(p, b);
      n = s.pages - s.first;
    }
    int x = n;  // inclusive scan: in the warp, then over the warps' sums
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = warp_sums[lane];
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    const int before = carry + (warp ? warp_sums[warp - 1] : 0) + x - n;
    if (b < p.batch) p.offsets[b] = before;
    __syncthreads();
    if (threadIdx.x == PLAN_THREADS - 1) carry = before + n;
  }
}

// Scratch page offsets[b] + slot: sequence b's table page first + slot, K and V, if the sequence reaches it and the
// scratch holds it (its capacity is the caller's bound). Rows past the sequence's last key become zeros (a recycled
// page's tail may hold NaN bytes). Slot 0 also writes the scratch table's row b and the sequence's key count.
__device__ void dequantize_page(const fp8_pages_problem& p, int b, int slot) {
  const seq_pages s = pages_of(p, b);
  const int start = p.offsets[b], count = s.pages - s.first;
  if (slot == 0) {
    for (int j = threadIdx.x; j < p.max_pages; j += PAGE_THREADS)
      p.table_out[long(b) * p.max_pages + j] = min(start + min(max(j - s.first, 0), max(count - 1, 0)), p.capacity - 1);
    if (threadIdx.x == 0) p.seqused_out[b] = min(max(s.keys, 0), p.max_pages * p.block_size);
  }
  const int j = s.first + slot;
  if (j >= s.pages || start + slot >= p.capacity) return;
  const long page = __ldg(p.block_table + b * p.bt_stride + j);
  const int units_per_head = p.head_dim / 16, units = p.block_size * p.hkv * units_per_head;
  const int live = s.keys - j * p.block_size;  // the page's rows that hold keys
#pragma unroll 1
  for (int kv = 0; kv < 2; kv++) {
    const uint8_t* src = static_cast<const uint8_t*>(kv ? p.v : p.k);
    const long* strides = kv ? p.v_strides : p.k_strides;
    half* dst = static_cast<half*>(kv ? p.v_out : p.k_out) + long(start + slot) * p.block_size * p.hkv * p.head_dim;
    for (int u = threadIdx.x; u < units; u += PAGE_THREADS) {
      const int token = u / (p.hkv * units_per_head), h = u / units_per_head % p.hkv, c = u % units_per_head * 16;
      uint4 lo{0, 0, 0, 0}, hi{0, 0, 0, 0};
      if (token < live) {
        const float scale = kv ? descale_at(p.descales.v, p.descales.v_strides, b, h)
                               : descale_at(p.descales.k, p.descales.k_strides, b, h) *
                                     descale_at(p.descales.q, p.descales.q_strides, b, h);
        const uint4 x =
            __ldg(reinterpret_cast<const uint4*>(src + page * strides[0] + token * strides[1] + h * strides[2] + c));
        dequantize_unit(x, scale, lo, hi);
      }
      uint4* out = reinterpret_cast<uint4*>(dst + (long(token) * p.hkv + h) * p.head_dim + c);
      out[0] = lo;
      out[1] = hi;
    }
  }
}

// Each block takes the (sequence, slot) pairs blockIdx.x, + gridDim.x, ...: a grid of bounded size however many
// pages the batch reads.
__global__ void __launch_bounds__(PAGE_THREADS) dequantize_pages(const fp8_pages_problem p) {
  const long pairs = long(p.batch) * p.slots;
  for (long i = blockIdx.x; i < pairs; i += gridDim.x) dequantize_page(p, int(i / p.slots), int(i % p.slots));
}

}  // namespace

void fp8_pages_dequantize(const fp8_pages_problem& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  plan_pages<<<1, PLAN_THREADS, 0, stream>>>(p);
  TK_LAUNCH_CHECK();
  const int grid = int(std::min<long>(long(p.batch) * p.slots, MAX_PAGE_BLOCKS));
  dequantize_pages<<<grid, PAGE_THREADS, 0, stream>>>(p);
  TK_LAUNCH_CHECK();
}

}  // namespace tk
