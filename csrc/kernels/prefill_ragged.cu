// Attention prefill at head dims between the tile sizes (multiples of 8 below 256 other than 64 and 128, e.g. Phi-3's
// 96): every prefill kernel on the next tile up, its extra columns zero-filled on chip by TMA.
#include "attention.h"
#include "prefill/launch.cuh"

namespace tk {

void attn_varlen_ragged_head(const attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  prefill::run_problem<prefill::flavour::ragged_head_dim>(p, num_sms, stream);
}

}  // namespace tk
