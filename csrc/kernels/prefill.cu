// Attention prefill on kittens: the host entry points. A launch picks its kernel variant from the policy table
// (prefill/policy.cuh) and launches it on a persistent grid (prefill/launch.cuh, prefill/kernel.cuh).
#include "attention.h"
#include "prefill/launch.cuh"

namespace tk {

void attn_varlen_with_sinks(const attn_varlen_problem& p, int num_sms, cudaStream_t stream);   // prefill_sinks.cu
void attn_varlen_ragged_head(const attn_varlen_problem& p, int num_sms, cudaStream_t stream);  // prefill_ragged.cu

bool attn_varlen_claims(const attn_varlen_problem& p) {
  return prefill::policy_of(prefill::select_variant(p)).walk == prefill::task_walk::claimed;
}

void attn_varlen(const attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  if (p.max_seqlen_q <= 0 || p.batch <= 0) return;
  if (p.sinks != nullptr) return attn_varlen_with_sinks(p, num_sms, stream);
  if (p.head_dim != prefill::tile_head_dim(p.head_dim)) return attn_varlen_ragged_head(p, num_sms, stream);
  prefill::run_problem<prefill::flavour::plain>(p, num_sms, stream);
}

}  // namespace tk
