// Split-KV paged decode at head dims between the tile sizes (e.g. Phi-3's 96): every decode kernel on the next tile
// up, its extra columns zero-filled on chip by TMA.
#include "attention.h"
#include "decode/launch.cuh"

namespace tk {

void attn_decode_ragged_head(const attn_decode_problem& p, cudaStream_t stream) {
  decode::run_problem<decode::flavour::ragged_head_dim>(p, stream);
}

}  // namespace tk
