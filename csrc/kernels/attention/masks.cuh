// Which keys a query sees: causal masks, sliding windows and sequence ends, under flash-attn's bottom-right
// alignment. Shared by prefill and decode.
#pragma once
#include <climits>
#include "../../kittens/kittens.cuh"

namespace tk::attn {

// Key c of a sequence with lk keys is visible to query q (0-based among its lq queries) under flash-attn's
// bottom-right alignment (offset = lk - lq), a causal mask and a (left, right) window (-1: unbounded).
// Packed: score-tile rows hold several rows per query (decode packs a KV head's query heads), query =
// row / per_query; otherwise row = query.
template <bool Packed = false>
struct visibility {
  int lk, offset, left, right, per_query;
  bool causal;

  __device__ __forceinline__ int query(int row) const { return Packed ? row / per_query : row; }
  // The keys row sees, [lo, hi] (empty when hi < lo): c < lk; c <= q + offset when causal; and
  // q + offset - left <= c <= q + offset + right for the bounds of the window that are set.
  __device__ __forceinline__ void keys(int row, int& lo, int& hi) const {
    const int q = query(row) + offset;
    hi = lk - 1;
    if (causal) hi = min(hi, q);
    if (right >= 0) hi = min(hi, q + right);
    lo = left >= 0 ? q - left : INT_MIN / 2;
  }
  // partial's test as bounds on col0, for kernels whose rows stay put over a task's tiles: worked out once, then two
  // compares a tile (partial keeps its own expression: built on this, the serial D=128 kernel spilled).
  // hidden_after: tiles past it hide every key from every row (a caller may skip their softmax).
  struct span {
    int after, before, hidden_after;
    __device__ __forceinline__ bool masks(int col0) const { return (col0 > after) | (col0 < before); }
    __device__ __forceinline__ bool hides(int col0) const { return col0 > hidden_after; }
  };
  __device__ __forceinline__ span mask_span(int row0, int rows, int cols) const {
    const int q_lo = query(row0) + offset, q_hi = query(row0 + rows - 1) + offset;
    int after = lk - cols, hidden = lk - 1;  // c_hi = col0 + cols - 1 >= lk; col0 >= lk
    if (causal) {
      after = min(after, q_lo - cols + 1);  // c_hi > q_lo
      hidden = min(hidden, q_hi);           // col0 > q_hi
    }
    if (right >= 0) {
      after = min(after, q_lo + right - cols + 1);
      hidden = min(hidden, q_hi + right);
    }
    return {after, left >= 0 ? q_hi - left : INT_MIN, hidden};
  }
  // Does the tile [row0, row0 + rows) x [col0, col0 + cols) hide any key from any of its rows?
  __device__ __forceinline__ bool partial(int row0, int rows, int col0, int cols) const {
    const int q_lo = query(row0), q_hi = query(row0 + rows - 1), c_hi = col0 + cols - 1;
    return (c_hi >= lk) | (causal & (c_hi > q_lo + offset)) | ((left >= 0) & (col0 < q_hi + offset - left)) |
           ((right >= 0) & (c_hi > q_lo + offset + right));
  }
};

}  // namespace tk::attn
