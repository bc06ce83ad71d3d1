// Split-KV paged decode with attention sinks (gpt-oss): the sink variants of every decode kernel and merge.
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

void attn_decode_with_sinks(const attn_decode_problem& p, cudaStream_t stream) {
  decode::run_problem<decode::flavour::sinks>(p, stream);
}

}  // namespace tk
