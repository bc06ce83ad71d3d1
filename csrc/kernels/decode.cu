// Split-KV paged decode on kittens: the host entry point. A launch picks its kernel variant from the policy table
// (decode/policy.cuh) and runs it (decode/launch.cuh).
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

void attn_decode_with_sinks(const attn_decode_problem& p, cudaStream_t stream);   // decode_sinks.cu
void attn_decode_ragged_head(const attn_decode_problem& p, cudaStream_t stream);  // decode_ragged.cu

void attn_decode(const attn_decode_problem& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  if (p.sinks != nullptr) return attn_decode_with_sinks(p, stream);
  if (p.head_dim != decode::tile_head_dim(p.head_dim)) return attn_decode_ragged_head(p, stream);
  decode::run_problem<decode::flavour::plain>(p, stream);
}

}  // namespace tk
