// Split-KV paged decode over FP8 (e4m3) caches with an e4m3 query (vLLM quantizes its query per tensor for an fp8
// cache): S = Q K^T is an e4m3 wgmma on the ring's 1-byte K tiles, and only V converts to fp16 for P V
// (decode/kernel.cuh, P.fp8_q), and the merges.
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

void attn_decode_fp8_query(const attn_decode_problem& p, const attn_kv_descales& descales, cudaStream_t stream) {
  if (p.batch <= 0) return;
  decode::run_problem<decode::flavour::fp8_qk>(p, stream, descales);
}

}  // namespace tk
