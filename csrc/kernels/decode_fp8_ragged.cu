// Split-KV paged decode over FP8 (e4m3) caches at head dims between the tile sizes: every decode kernel on the next
// tile up, its extra columns zero-filled on chip.
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

void attn_decode_fp8_ragged(const attn_decode_problem& p, const attn_kv_descales& descales, cudaStream_t stream) {
  decode::run_problem<decode::flavour::fp8_kv_ragged_head_dim>(p, stream, descales);
}

}  // namespace tk
