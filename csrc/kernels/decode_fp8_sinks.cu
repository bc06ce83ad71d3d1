// Split-KV paged decode over FP8 (e4m3) caches with attention sinks: those variants of every decode kernel and merge.
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

void attn_decode_fp8_sinks(const attn_decode_problem& p, const attn_kv_descales& descales, cudaStream_t stream) {
  decode::run_problem<decode::flavour::fp8_kv_sinks>(p, stream, descales);
}

}  // namespace tk
