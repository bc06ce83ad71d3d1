// Split-KV paged decode over FP8 (e4m3) caches: the fp8 variant of every decode kernel, which streams 1-byte K/V
// tiles and dequantizes them on chip (decode/dequant.cuh), and their merges. The plain kernels here; the sink and
// ragged-head-dim ones in TUs of their own (this one alone took twice any other TU's compile time, the build's
// critical path).
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

// decode_fp8_sinks.cu, decode_fp8_ragged.cu
void attn_decode_fp8_sinks(const attn_decode_problem& p, const attn_kv_descales& d, cudaStream_t s);
void attn_decode_fp8_ragged(const attn_decode_problem& p, const attn_kv_descales& d, cudaStream_t s);

void attn_decode_fp8(const attn_decode_problem& p, const attn_kv_descales& descales, cudaStream_t stream) {
  if (p.batch <= 0) return;
  if (p.sinks != nullptr) return attn_decode_fp8_sinks(p, descales, stream);
  if (p.head_dim != decode::tile_head_dim(p.head_dim)) return attn_decode_fp8_ragged(p, descales, stream);
  decode::run_problem<decode::flavour::fp8_kv>(p, stream, descales);
}

}  // namespace tk
