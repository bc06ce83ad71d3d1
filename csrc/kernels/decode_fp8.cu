// Split-KV paged decode over FP8 (e4m3) caches: the fp8 variant of every decode kernel (plain, with sinks, at ragged
// head dims), which streams 1-byte K/V tiles and dequantizes them on chip (decode/dequant.cuh), and their merges.
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

void attn_decode_fp8(const attn_decode_problem& p, const attn_kv_descales& descales, cudaStream_t stream) {
  using decode::flavour;
  if (p.batch <= 0) return;
  if (p.sinks != nullptr) return decode::run_problem<flavour::fp8_kv_sinks>(p, stream, descales);
  if (p.head_dim != decode::tile_head_dim(p.head_dim))
    return decode::run_problem<flavour::fp8_kv_ragged_head_dim>(p, stream, descales);
  decode::run_problem<flavour::fp8_kv>(p, stream, descales);
}

}  // namespace tk
