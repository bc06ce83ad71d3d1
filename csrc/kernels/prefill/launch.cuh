// Prefill's host side: a launch's globals from the problem, and the dispatch over the policy table. Included by
// prefill.cu, prefill_sinks.cu and prefill_ragged.cu, each instantiating its flavour of the variants (translation
// units build in parallel). The kernels are each translation unit's own (an anonymous namespace: internal linkage, so a `.entry`,
// not an exported one, as ptxas lays out their shared memory).
#pragma once
#include <algorithm>
#include "../../kittens/kittens.cuh"
#include "../attention.h"
#include "kernel.cuh"

namespace tk::prefill {
namespace {

using namespace kittens;


// The kernel as this translation unit's own (internal linkage: a `.entry`, not an exported one, as ptxas lays it out).
template <typename T, policy P>
struct local_kernel : attn_prefill<T, P> {};

template <typename T, policy P>
void run(const attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  using K = local_kernel<T, P>;
  constexpr int D = P.head_dim;
  auto ptr = [](const void* x) { return static_cast<T*>(const_cast<void*>(x)); };
  const bool paged = p.block_table != nullptr;
  typename K::globals g{};
  const long d = p.head_dim;  // D, or less with ragged_head_dim
  g.q = {ptr(p.q), {1, p.hq, p.total_q, d}, {0, p.q_head_stride, p.q_token_stride, 1}};
  g.o = {ptr(p.o), {1, p.hq, p.total_q, d}, {0, p.o_head_stride, p.o_token_stride, 1}};
  if (paged) {
    g.k_pages = {ptr(p.k), {p.num_blocks, p.hkv, p.block_size, d}, {p.k_strides[0], p.k_strides[2], p.k_strides[1], 1}};
    g.v_pages = {ptr(p.v), {p.num_blocks, p.hkv, p.block_size, d}, {p.v_strides[0], p.v_strides[2], p.v_strides[1], 1}};
  } else {
    g.k = {ptr(p.k), {1, p.hkv, p.total_k, d}, {0, p.k_strides[1], p.k_strides[0], 1}};
    g.v = {ptr(p.v), {1, p.hkv, p.total_k, d}, {0, p.v_strides[1], p.v_strides[0], 1}};
  }
  g.lse = p.lse;
  g.lse_stride = p.lse_stride;
  g.cu_q = p.cu_seqlens_q;
  g.cu_k = p.cu_seqlens_k;
  g.seqused_k = p.seqused_k;
  g.block_table = p.block_table;
  g.bt_stride = p.bt_stride;
  g.batch = p.batch;
  g.hq = p.hq;
  g.group = p.hq / p.hkv;
  g.q_blocks = ceil_div(p.max_seqlen_q, K::BQ);
  g.paged = paged;
  g.causal = p.causal;
  g.window_left = p.window_left;
  g.window_right = p.window_right;
  g.scale_log2 = p.softmax_scale * tk::attn::LOG2E;
  g.softcap = p.softcap;
  const long tasks = long(g.q_blocks) * p.batch * p.hq;
  const int ctas = int(std::min<long>(tasks, num_sms));
  g.heads_per_group = heads_per_l2_group(p, D, g.q_blocks, ctas);
  const int pairs = p.batch * p.hq, last_group_heads = pairs - (pairs - 1) / g.heads_per_group * g.heads_per_group;
  g.ctas_div = divisor(ctas);
  g.per_group_div = divisor(g.heads_per_group * g.q_blocks);
  g.group_heads_div = divisor(g.heads_per_group);
  g.last_group_heads_div = divisor(last_group_heads);
  g.hq_div = divisor(p.hq);
  g.group_div = divisor(g.group);
  g.block_size = p.block_size;
  g.block_size_div = divisor(paged ? p.block_size : 1);
  g.sinks = p.sinks;
  if constexpr (P.walk == task_walk::claimed) {
    g.task_counter = p.task_counter;
    TK_CUDA_CHECK(cudaMemsetAsync(p.task_counter, 0, sizeof(int), stream));
  }
  lcsf::launch<K>(g, ctas, stream);
}

// The variants' flavour: plain, with_sinks or with_ragged_head_dim (each its own translation unit: prefill*.cu).
enum class flavour { plain, sinks, ragged_head_dim };

template <typename T, flavour F>
void run_dtype(const attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  constexpr auto pick = [](policy base) {
    return F == flavour::sinks ? with_sinks(base) : F == flavour::ragged_head_dim ? with_ragged_head_dim(base) : base;
  };
  switch (select_variant(p)) {
    case variant::d64: return run<T, pick(d64)>(p, num_sms, stream);
    case variant::d64_softcap: return run<T, pick(d64_softcap)>(p, num_sms, stream);
    case variant::d64_window: return run<T, pick(d64_window)>(p, num_sms, stream);
    case variant::d128_short: return run<T, pick(d128_short)>(p, num_sms, stream);
    case variant::d128_long: return run<T, pick(d128_long)>(p, num_sms, stream);
    case variant::d128_long_causal: return run<T, pick(d128_long_causal)>(p, num_sms, stream);
    case variant::d128_long_causal_claimed: return run<T, pick(d128_long_causal_claimed)>(p, num_sms, stream);
    case variant::d256: return run<T, pick(d256)>(p, num_sms, stream);
    case variant::d256_causal: return run<T, pick(d256_causal)>(p, num_sms, stream);
  }
}

template <flavour F>
void run_problem(const attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  if (p.type == dtype::bf16) run_dtype<bf16, F>(p, num_sms, stream);
  else run_dtype<half, F>(p, num_sms, stream);
}
}  // namespace
}  // namespace tk::prefill
