// Decode's host side: a launch's globals from the problem, schedule (balanced mode) -> decode -> merge, each chained
// to the one before, and the dispatch over the policy table. Included by decode.cu, decode_sinks.cu,
// decode_ragged.cu and decode_fp8.cu, each instantiating its flavour of the variants. The kernels are each
// translation unit's own (an anonymous namespace: internal linkage, so a `.entry`, not an exported one, as ptxas
// lays out their shared memory).
#pragma once
#include "../../kittens/kittens.cuh"
#include "../attention.h"
#include "kernel.cuh"
#include "merge.cuh"
#include "schedule.cuh"

namespace tk::decode {
namespace {

using namespace kittens;


// The kernel as this translation unit's own (internal linkage: a `.entry`, not an exported one, as ptxas lays it out).
template <typename T, policy P, schedule_source Source>
struct local_kernel : attn_decode_split<T, P, Source> {};

// The L2 fill of a cache row's TMA read. A head's row of at most 128 bytes (D=64 in 16 bits, D <= 128 in fp8)
// beside other heads' rows (vLLM's [blocks, block_size, heads, D]) would bring a neighbouring head's row along,
// which, when a CTA runs a sequence's heads one after another (B >= 64: several items a CTA), is read much later,
// long evicted: the fill stops at the row's 128 bytes then, at every batch (measured neutral at b1 / b8, where
// the neighbour's CTA runs beside it; docs/findings/decode.md#decode-l2-rows).
template <typename Cache>
CUtensorMapL2promotion row_promotion(long head_dim, long token_stride) {
  const long row_bytes = head_dim * long(sizeof(Cache));
  return row_bytes <= 128 && token_stride > head_dim ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                     : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
}

template <typename T, policy P, schedule_source Source>
void launch(const tk::attn_decode_problem& p, const tk::attn_kv_descales& descales, cudaStream_t stream) {
  using K = local_kernel<T, P, Source>;
  constexpr int D = P.head_dim;
  auto cache = [](const void* x) { return static_cast<typename K::cache_t*>(const_cast<void*>(x)); };
  const int group = p.hq / p.hkv, rows = p.q_len * group;
  typename K::globals g{};
  const long d = p.head_dim;  // D, or less with ragged_head_dim
  g.k = {cache(p.k), {p.num_blocks, p.hkv, p.block_size, d}, {p.k_strides[0], p.k_strides[2], p.k_strides[1], 1},
         row_promotion<typename K::cache_t>(d, p.k_strides[1])};
  g.v = {cache(p.v), {p.num_blocks, p.hkv, p.block_size, d}, {p.v_strides[0], p.v_strides[2], p.v_strides[1], 1},
         row_promotion<typename K::cache_t>(d, p.v_strides[1])};
  g.q = static_cast<const typename K::q_elem_t*>(p.q);  // T, or e4m3 (P.fp8_q)
  for (int i = 0; i < 3; i++) g.q_strides[i] = p.q_strides[i];
  g.cache_seqlens = p.cache_seqlens;
  g.block_table = p.block_table;
  g.bt_stride = p.bt_stride;
  g.work_items = p.work_items;
  g.cta_start = p.cta_start;
  g.partial_out = {p.partial_out, {1, p.max_items, rows, D}};
  g.partial_lse = p.partial_lse;
  g.q_len = p.q_len;
  g.group = group;
  g.block_size = p.block_size;
  g.causal = p.causal;
  g.window_left = p.window_left;
  g.window_right = p.window_right;
  g.scale_log2 = p.softmax_scale * tk::attn::LOG2E;
  g.softcap = p.softcap;
  g.sched = schedule_rule_of(p);
  g.balanced = p.balanced;
  g.bal = balanced_rule_of<K::KV>(p);
  g.direct = !p.balanced && p.max_items <= p.num_ctas;  // one slot per CTA: nothing to balance
  g.single = !p.balanced && p.max_splits == 1;
  g.out = static_cast<T*>(p.out);
  for (int i = 0; i < 3; i++) g.out_strides[i] = p.out_strides[i];
  g.lse = p.lse;
  g.hq = p.hq;
  g.sinks = p.sinks;
  g.head_dim = p.head_dim;
  g.descales = descales;
  constexpr int partial_cols = P.ragged_head_dim ? D : 0;  // the merge's partial rows: the tile's columns
  if (g.balanced) {
    if (!p.reuse_schedule) {
      build_balanced<K::KV><<<1, SCHEDULE_THREADS, 0, stream>>>(p);
      TK_LAUNCH_CHECK();
    }
    lcsf::launch<K>(g, p.num_ctas, stream);
    chain::launch(merge_balanced<T, K::KV, P.sinks, partial_cols>, p.batch * p.hkv * rows, D, 2 * (p.num_ctas + 1) * sizeof(int), stream, p,
                  group);
    return;
  }
  lcsf::launch<K>(g, g.direct ? p.max_items : p.num_ctas, stream);
  if (g.single) return;
  chain::launch(merge_partials<T, P.sinks, partial_cols>, p.batch * p.hkv * rows, D, merge_weights(p.max_splits) * sizeof(float), stream, p,
                group);
}

// The static schedule's kernel works out its ranges itself (self_schedule) unless the step has one already (an earlier
// layer's) or there is nothing to schedule (direct, balanced).
template <typename T, policy P>
void run(const tk::attn_decode_problem& p, const tk::attn_kv_descales& d, cudaStream_t stream) {
  const bool direct = !p.balanced && p.max_items <= p.num_ctas;
  if (!p.balanced && !direct && !p.reuse_schedule) return launch<T, P, schedule_source::self>(p, d, stream);
  launch<T, P, schedule_source::reads>(p, d, stream);
}

// The variants' flavour: plain, with_sinks, with_ragged_head_dim, or one of those over fp8 caches, or an e4m3 query
// over them (each its own translation unit: decode*.cu).
enum class flavour { plain, sinks, ragged_head_dim, fp8_kv, fp8_kv_sinks, fp8_kv_ragged_head_dim, fp8_qk };

template <flavour F>
constexpr policy policy_of(variant v) {
  constexpr bool fp8 = F == flavour::fp8_kv || F == flavour::fp8_kv_sinks || F == flavour::fp8_kv_ragged_head_dim;
  policy p = v == variant::d64 ? d64 : v == variant::d128 ? d128 : v == variant::d128_kv64 ? d128_kv64 : d256;
  if (fp8) p = v == variant::d64 ? d64_fp8 : v == variant::d256 ? d256_fp8 : d128_kv64_fp8;  // policy.cuh: D=128
  if (F == flavour::fp8_qk)
    p = v == variant::d64 ? d64_fp8q : v == variant::d256 ? d256_fp8q : v == variant::d128 ? d128_fp8q : d128_kv64_fp8q;
  if (F == flavour::sinks || F == flavour::fp8_kv_sinks) p = with_sinks(p);
  if (F == flavour::ragged_head_dim || F == flavour::fp8_kv_ragged_head_dim) p = with_ragged_head_dim(p);
  return p;
}

template <typename T, flavour F>
void run_dtype(const tk::attn_decode_problem& p, const tk::attn_kv_descales& d, cudaStream_t stream) {
  switch (select_variant(p)) {
    case variant::d64: return run<T, policy_of<F>(variant::d64)>(p, d, stream);
    case variant::d128: return run<T, policy_of<F>(variant::d128)>(p, d, stream);
    case variant::d128_kv64: return run<T, policy_of<F>(variant::d128_kv64)>(p, d, stream);
    case variant::d256: return run<T, policy_of<F>(variant::d256)>(p, d, stream);
  }
}

// descales: the fp8 flavours' (the others read none).
template <flavour F>
void run_problem(const tk::attn_decode_problem& p, cudaStream_t stream, const tk::attn_kv_descales& descales = {}) {
  if (p.type == dtype::bf16) run_dtype<bf16, F>(p, descales, stream);
  else run_dtype<half, F>(p, descales, stream);
}
}  // namespace
}  // namespace tk::decode
