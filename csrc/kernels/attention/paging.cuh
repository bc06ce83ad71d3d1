// Paged K/V: a tile's rows gathered page piece by page piece through the block table. Shared by prefill and decode.
#pragma once
#include "../../kittens/kittens.cuh"

namespace tk::attn {

// block_size: an int, or a kittens::divisor (a multiply and a shift a piece instead of a division).
__device__ __forceinline__ int div_by(int n, int d) { return n / d; }
__device__ __forceinline__ int mod_by(int n, int d) { return n % d; }
__device__ __forceinline__ int div_by(int n, const kittens::divisor& d) { return d.div(n); }
__device__ __forceinline__ int mod_by(int n, const kittens::divisor& d) { return d.mod(n); }

// A paged K/V tile's PIECES pieces: token_of(s) is piece s's first token, copy(s, page, row_in_page) issues its
// copies. LOOKUPS pieces' pages are looked up before their copies, so the lookups are in flight together (a TMA
// issue is a memory barrier to the compiler); by default two, not all of a tile's, so the producer keeps its
// registers few.
template <int PIECES, int LOOKUPS_WANTED = 2, typename BlockSize, typename TokenOf, typename Copy>
__device__ __forceinline__ void paged_pieces(const int* pages, const BlockSize& block_size, TokenOf token_of,
                                             Copy copy) {
  constexpr int LOOKUPS = PIECES % LOOKUPS_WANTED == 0 ? LOOKUPS_WANTED : 1;
#pragma unroll
  for (int s0 = 0; s0 < PIECES; s0 += LOOKUPS) {
    int token[LOOKUPS], page[LOOKUPS];
#pragma unroll
    for (int i = 0; i < LOOKUPS; i++) {
      token[i] = token_of(s0 + i);
      page[i] = __ldg(pages + div_by(token[i], block_size));
    }
#pragma unroll
    for (int i = 0; i < LOOKUPS; i++) copy(s0 + i, page[i], mod_by(token[i], block_size));
  }
}

}  // namespace tk::attn
