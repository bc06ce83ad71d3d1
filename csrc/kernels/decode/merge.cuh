// Decode's LSE merge: a segment's partial outputs, weighted by exp(lse - max), into out and lse.
// The kernels are static (internal linkage): each translation unit that launches them has its own.
#pragma once
#include "../../kittens/kittens.cuh"
#include "../attention.h"
#include "schedule.cuh"

namespace tk::decode {

// The LSE merge's two halves, shared by both modes' merge kernels (one block per (segment, row), a thread per
// column). Warp 0, with weight[0, n) staged and m its lanes' partial maximum: the weights become
// exp(lse - max) (0 for -inf, i.e. no piece), and every lane returns (max, sum).
static __device__ float2 lse_weights(float* weight, int n, float m) {
  for (int o = 16; o; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  __syncwarp();
  float sum = 0.f;
  for (int k = threadIdx.x; k < n; k += 32) {
    const float x = weight[k] == -INFINITY ? 0.f : __expf(weight[k] - m);
    weight[k] = x;
    sum += x;
  }
  for (int o = 16; o; o /= 2) sum += __shfl_xor_sync(~0u, sum, o);
  return {m, sum};
}
// The merged row out: column col is column(col) (the weighted sum of the pieces' outputs) over the weights' sum,
// and the row's LSE (-inf for a row no key reached).
// Sinks: the row takes its head's attention-sink logit (tk::attn::sink_factor / lse_with_sink).
template <typename T, bool Sinks, typename Column>
static __device__ void write_merged_row(const tk::attn_decode_problem& p, int b, int h, int row, int group, float row_max,
                                 float row_sum, Column column) {
  const int tok = row / group, head = h * group + row % group;
  float inv = row_sum > 0.f ? 1.f / row_sum : 0.f, lse_sink = 0.f;
  if constexpr (Sinks) {
    const float lse = row_sum > 0.f ? row_max + __logf(row_sum) : -INFINITY, sink = p.sinks[head];
    inv *= tk::attn::sink_factor(lse, sink);
    lse_sink = tk::attn::lse_with_sink(lse, sink);
  }
  for (int col = threadIdx.x; col < p.head_dim; col += blockDim.x)
    static_cast<T*>(p.out)[b * p.out_strides[0] + tok * p.out_strides[1] + head * p.out_strides[2] + col] =
        kittens::convert<T>(column(col) * inv);
  if (threadIdx.x == 0)
    p.lse[(long(b) * p.hq + head) * p.q_len + tok] =
        Sinks ? lse_sink : row_sum > 0.f ? row_max + __logf(row_sum) : -INFINITY;
}

// Balanced mode's merge: one block per (segment, row), a thread per column. The segment's pieces lie in the
// CTAs [cta_of(at), cta_of(at + units - 1)]; warp 0 stages each one's slot and weight in shared memory (slot -1:
// no piece there), and a segment whose one piece was whole is left alone (the decode kernel wrote it).
// PartialCols: the partial rows' columns when not the head dim's (a ragged head dim's tile), else 0.
template <typename T, int ALIGN, bool Sinks, int PartialCols>
static __global__ void merge_balanced(tk::attn_decode_problem p, int group) {
  extern __shared__ int staged[];  // [2 * (ctas + 1)]: slots, then weights (as float bits)
  __shared__ float row_max, row_sum;
  __shared__ int count, whole;
  chain::wait();  // launched chained to the decode kernel: its pieces are complete from here on
  const balanced_rule r = balanced_rule_of<ALIGN>(p);
  const int rows = p.q_len * group, seg = blockIdx.x / rows, row = blockIdx.x % rows;
  const int b = seg / p.hkv, h = seg % p.hkv, span = p.num_ctas + 1;
  float* weight = reinterpret_cast<float*>(staged + span);
  if (threadIdx.x < 32) {
    const long long total = r.seq_at[p.batch], units = r.cost(r.visible(b));
    int c0 = 0, n = 0;
    if (units > 0) {
      const long long at = r.seq_at[b] + h * units;
      c0 = r.cta_of(at, total), n = r.cta_of(at + units - 1, total) - c0 + 1;
    }
    float m = -INFINITY;
    bool is_whole = false;
    for (int k = threadIdx.x; k < n; k += 32) {
      const int4 pc = r.piece(c0 + k, b, h, total);
      const bool live = pc.y > pc.x;
      is_whole |= live && pc.z < 0;
      staged[k] = live && pc.z >= 0 ? pc.z : -1;
      weight[k] = staged[k] >= 0 ? p.partial_lse[long(staged[k]) * rows + row] : -INFINITY;
      m = fmaxf(m, weight[k]);
    }
    is_whole = __any_sync(~0u, is_whole);
    const float2 ms = lse_weights(weight, n, m);
    if (threadIdx.x == 0) row_max = ms.x, row_sum = ms.y, count = n, whole = is_whole;
  }
  __syncthreads();
  if (whole) return;  // written by the decode kernel
  write_merged_row<T, Sinks>(p, b, h, row, group, row_max, row_sum, [&](int col) {
    float acc = 0.f;
    for (int k = 0; k < count; k++)
      if (weight[k] > 0.f) acc += weight[k] * p.partial_out[(long(staged[k]) * rows + row) * (PartialCols > 0 ? PartialCols : p.head_dim) + col];
    return acc;
  });
}

// merge_partials' weights in shared memory: whole float4s, because ptxas reads the unrolled sum's tail as one
// 16-byte load (compute-sanitizer flagged the over-read). The padding holds -inf: never a weight.
constexpr int merge_weights(int max_splits) { return (max_splits + 3) / 4 * 4; }

// The LSE merge of a segment's items: one block per (sequence, kv head, row), a thread per column. The
// items' LSEs are staged in shared memory once; then each thread sums its column over the items.
template <typename T, bool Sinks, int PartialCols>
static __global__ void merge_partials(tk::attn_decode_problem p, int group) {
  extern __shared__ float weight[];  // [merge_weights(max_splits)]
  __shared__ float row_max, row_sum;
  chain::wait();  // launched chained to the decode kernel: its items are complete from here on
  const int rows = p.q_len * group, seg = blockIdx.x / rows, r = blockIdx.x % rows;
  const int b = seg / p.hkv, h = seg % p.hkv, first = seg * p.max_splits;
  const int4 lead = reinterpret_cast<const int4*>(p.work_items)[first];
  if (slot_rule_of(p).whole(b, lead.z, lead.w)) return;  // the decode kernel wrote this segment's rows
  for (int s = threadIdx.x; s < merge_weights(p.max_splits); s += blockDim.x) {
    weight[s] = -INFINITY;
    if (s >= p.max_splits) continue;
    const int4 w = reinterpret_cast<const int4*>(p.work_items)[first + s];
    if (w.w > w.z) weight[s] = p.partial_lse[long(first + s) * rows + r];
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    float m = -INFINITY;
    for (int s = threadIdx.x; s < p.max_splits; s += 32) m = fmaxf(m, weight[s]);
    const float2 ms = lse_weights(weight, p.max_splits, m);
    if (threadIdx.x == 0) row_max = ms.x, row_sum = ms.y;
  }
  __syncthreads();
  write_merged_row<T, Sinks>(p, b, h, r, group, row_max, row_sum, [&](int col) {
    float acc = 0.f;
    if (row_sum > 0.f) {
#pragma unroll 4
      for (int s = 0; s < p.max_splits; s++)
        if (weight[s] > 0.f) acc += weight[s] * p.partial_out[(long(first + s) * rows + r) * (PartialCols > 0 ? PartialCols : p.head_dim) + col];
    }
    return acc;
  });
}

}  // namespace tk::decode
