// Attention prefill with attention sinks (gpt-oss): the sink variants of every prefill kernel (head dims 64, 128, 256).
#include "attention.h"
#include "prefill/launch.cuh"

namespace tk {

void attn_varlen_with_sinks(const attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  prefill::run_problem<prefill::flavour::sinks>(p, num_sms, stream);
}

}  // namespace tk
