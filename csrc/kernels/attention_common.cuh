// Pieces shared by the attention kernels (prefill and decode): which keys a query sees, and the online
// softmax step over one score tile.
#pragma once
#include <cfloat>
#include <climits>
#include "../kittens/kittens.cuh"

namespace tk::attn {

inline constexpr float LOG2E = 1.4426950408889634f;
inline constexpr float LN2 = 0.6931471805599453f;

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
  // partial's test as bounds on col0: tiles past `after` (keys past the end, causal, the window's right) or before
  // `before` (the window's left). A kernel whose rows stay put over a task's tiles works these out once and tests
  // two bounds a tile. (partial keeps its own expression: built on this, the serial D=128 kernel spilled.)
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

// How raw q.k scores become exp2 arguments: times scale * log2(e), or with a softcap
// softcap * tanh(score * scale / softcap) first (then times log2(e)).
struct scoring {
  float scale_log2, softcap;
  __device__ __forceinline__ float exp_scale() const { return softcap > 0.f ? LOG2E : scale_log2; }
};

// Lazy rescaling (as FlashAttention-4 does): the running max moves only when a tile's max passes it by more than
// this many powers of two. Probabilities then reach at most 2^8 (fine in fp32 sums and in bf16 / fp16 P), and on
// most tiles no row's max moves, so the output skips its rescale (a multiply per accumulator). Same-call A/B on the
// H200 (session 19), lazy over eager: D=256 0.94-0.96, D=64 0.98-0.99, D=128 causal n=1024 (two consumers) 0.99.
// Prefill's serial kernel (three consumers at D=128) is lazy only in its strided variant (full masks, paged K/V:
// session 21, paged 0.962-0.967, full n=1024-16384 0.996-1.009); at 160 registers, the branch around o's
// multiply makes the claimed-task variant spill 80-128 bytes in the consumer loop, so that one stays eager.
// Decode is lazy too (session 21: 0.976-1.004, most cases 0.98-0.99).
inline constexpr float RESCALE_THRESHOLD = 8.f;

// One online-softmax step on a warp's score tile `att` whose first row / column are row0 / col0:
// masks what `vis` hides (only when the tile needs it), folds the tile into the running max m and sum l (l in
// per-lane shares: the lanes holding a row each sum their own columns; finalize combines them),
// turns att into unnormalised probabilities and leaves in `rescale` the factor the output accumulated so
// far must take. m is kept in score units; a row that has seen no key yet keeps m = -inf. Lazy: m moves only
// past RESCALE_THRESHOLD, and the result says whether any row of the warp has a rescale other than exactly 1
// (warp-uniform: if not, the output may skip its multiply); otherwise it is true. RowSlots: the row slots of the
// tile that hold live rows (1: only rows lane / 4, the first 8 of the 16, as decode's packed queries of a small
// group); the others are left as they are (their m stays -inf and l 0), so their scores must be finite.
// `masked()`: whether the tile needs the mask (vis.partial, or a caller's span worked out once a task).
//
// Fast (every row of the warp has seen a key): the tile's exp2 are taken against the running
// max as it stands, without the tile's own row max (64 FMNMX and 4 shuffles a thread a 64 x 128 tile, ~15% of a
// prefill tile's instructions). The lane's share of each row's sum then bounds every probability it holds; if every
// share in the warp is at most FAST_SHARE_LIMIT (so P <= 2^15: fine in fp32 sums and in bf16 / fp16 P, as lazy
// rescaling's 2^8 is) the tile is done and the max stays (no rescale: the result is false). Otherwise (a max that
// jumped by more than 2^15 / 32, or a probability that overflowed) `recompute(att)` puts the raw scores back
// (S = Q K^T again, its wait included) and the exact step runs. A row that has seen no key yet (m = -inf) sends the
// warp to the exact step at once with FastIfSeen, and fails the test (after the recompute) without it: one vote
// less a tile, and ~140 bytes of spill less in the 160-register serial prefill kernel.
// `group_all(pred)`: whether pred holds in every warp of the group that runs the recompute's product (a
// warpgroup: all of its warps must issue it, or none).
// Fresh (a task's first tile): no row has seen a key yet (m = -inf, l = 0, the output 0), so the step skips the old
// max's rescale (two ex2 and the lazy test a row) and the output's (the result is false: 0 needs none).
// Fresh and Fast (seeded): the fast step against a guess at each row's max, its max over the tile's first 16 columns
// (SEED_BLOCKS: 12 FMNMX and 4 shuffles a thread, where the row max takes 68 and 4); the exact step (Fresh, from
// the scores recomputed) where the guess was too low for the share test, or left a row at -inf.
inline constexpr float FAST_SHARE_LIMIT = 32768.f;
inline constexpr int SEED_BLOCKS = 1;
template <bool Lazy, unsigned RowSlots, bool Fast, bool FastIfSeen, bool Fresh = false, typename S, typename V,
          typename Visibility, typename Masked, typename Recompute, typename GroupAll>
__device__ __forceinline__ bool online_softmax(S& att, V& m, V& l, V& rescale, const scoring& sc,
                                               const Visibility& vis, int row0, int col0, Masked masked,
                                               Recompute recompute, GroupAll group_all) {
  using namespace kittens;
  const float es = sc.exp_scale();
  const auto prepare = [&] {
    if (sc.softcap > 0.f) {
      // cap * tanh(y) = cap - 2 cap / (1 + 2^(2 log2(e) y)): one ex2 and one rcp a score. tanhf's long expansion
      // held enough registers across the loop to spill (D=128: 56 bytes), softcap or not. Saturates cleanly:
      // 2^+inf gives cap, 2^-inf gives -cap; the absolute error near 0 is ~1e-7 cap, far below bf16's.
      const float k = 2.f * sc.scale_log2 / sc.softcap, cap = sc.softcap, two_cap = 2.f * sc.softcap;
      map(att, att, [k, cap, two_cap](float x) { return cap - __fdividef(two_cap, 1.f + fast_exp2(x * k)); });
    }
    if (masked()) {
      const auto keys = [&vis](int row, int& lo, int& hi) { vis.keys(row, lo, hi); };
      // Without a window's left edge no row's keys start inside the tile: one compare an element, not two.
      // Same-call A/B (session 24, two rounds): dense causal prefill 0.975-0.992 at D=64 / 128, full masks and
      // decode within 1%.
      if (vis.left >= 0) mask_cols<RowSlots>(att, att, row0, col0, keys, -INFINITY);
      else mask_cols<RowSlots, false>(att, att, row0, col0, keys, -INFINITY);
    }
  };
  prepare();
  if constexpr (Fast) {
    if constexpr (Fresh) row_max_leading<SEED_BLOCKS, RowSlots>(m, att, m);  // the guess (m was -inf)
    bool seen = true;  // every row of the warp has seen a key (a task's first tile: none has)
#pragma unroll
    for (int b = 0; b < V::blocks; b++)
#pragma unroll
      for (int i = 0; i < V::per_lane; i++) seen &= m.data[b][i] != -INFINITY;
    seen = !FastIfSeen || __all_sync(0xffffffffu, seen);  // else a row's -inf base fails the test below
    V share;
    bool fits = true;  // an overflow (inf) fails the test
    if (seen) {
      V base;
      map(base, m, [es](float x) { return x * es; });
      map_row<RowSlots>(att, att, base, [es](float x, float b) { return fast_exp2(x * es - b); });
      zero(share);
      row_sum_share<RowSlots>(share, att, share);
#pragma unroll
      for (int b = 0; b < V::blocks; b++)
#pragma unroll
        for (int i = 0; i < V::per_lane; i++) fits &= share.data[b][i] <= FAST_SHARE_LIMIT;
    }
    // The recompute is a warpgroup's product: all of its warps run it if one needs it (a warp that skipped the
    // fast path gets its own scores back).
    if (group_all(fits)) {
      if (seen) {
        map(l, l, share, [](float x, float y) { return x + y; });
        return false;
      }
    } else {
      recompute(att);
      prepare();
    }
  }
  V m_new, base;
  row_max<RowSlots>(m_new, att, m);
  bool moved = false;  // Lazy: whether any of this lane's rows moved its max
  if constexpr (Fresh) {  // no old max to rescale from: l and the output stay as they are (0); a seed is <= m_new
    map(base, m_new, [es](float x) { return x == -INFINITY ? 0.f : x * es; });  // a row still masked: 0
    copy(m, m_new);
  } else if constexpr (Lazy) {
    // The old max stays unless the new one passes it by the threshold (-inf - -inf is NaN: a row still masked
    // keeps -inf; a first visible key always moves it). A row that keeps it takes rescale 1 exactly.
#pragma unroll
    for (int b = 0; b < V::blocks; b++)
#pragma unroll
      for (int i = 0; i < V::per_lane; i++) {
        const float old = m.data[b][i], x = m_new.data[b][i];
        const bool row_moved = (x - old) * es > RESCALE_THRESHOLD;
        const float mx = row_moved ? x : old;
        base.data[b][i] = mx == -INFINITY ? 0.f : mx * es;  // a row masked so far: 0
        rescale.data[b][i] = row_moved ? fast_exp2(old * es - base.data[b][i]) : 1.f;
        m.data[b][i] = mx;
        moved |= row_moved;
      }
  } else {
    map(base, m_new, [es](float x) { return x == -INFINITY ? 0.f : x * es; });  // a row masked so far: 0
    map(rescale, m, base, [es](float x, float b) { return fast_exp2(x * es - b); });
    copy(m, m_new);
  }
  map_row<RowSlots>(att, att, base, [es](float x, float b) { return fast_exp2(x * es - b); });
  if constexpr (!Fresh) map(l, l, rescale, [](float x, float r) { return x * r; });
  row_sum_share<RowSlots>(l, att, l);  // l in shares: the lanes of a row are combined once, in finalize
  if constexpr (Fresh) return false;  // the output is 0: it needs no rescale
  else if constexpr (Lazy) return __any_sync(0xffffffffu, moved);
  else return true;
}
// Without Fast (no recompute).
template <bool Lazy = false, unsigned RowSlots = ~0u, typename S, typename V, typename Visibility, typename Masked>
__device__ __forceinline__ bool online_softmax(S& att, V& m, V& l, V& rescale, const scoring& sc,
                                               const Visibility& vis, int row0, int col0, Masked masked) {
  return online_softmax<Lazy, RowSlots, false, false>(att, m, l, rescale, sc, vis, row0, col0, masked, [](S&) {},
                                               [](bool) { return true; });
}

template <bool Lazy = false, unsigned RowSlots = ~0u, typename S, typename V, typename Visibility>
__device__ __forceinline__ bool online_softmax(S& att, V& m, V& l, V& rescale, const scoring& sc,
                                               const Visibility& vis, int row0, int col0) {
  return online_softmax<Lazy, RowSlots>(att, m, l, rescale, sc, vis, row0, col0,
                                        [&] { return vis.partial(row0, S::rows, col0, S::cols); });
}

// o /= l, and the natural-log LSE of each row (-inf and o = 0 for a row that saw no key).
// Fast: the reciprocal and log2 as single approximate instructions (MUFU.RCP / MUFU.LG2, ~1 ulp), not the IEEE
// reciprocal's and log2f's range checks and slow paths: a row that saw a key has l >= 1 (its max key's
// probability is at least 1, the running max never passing the true one), far from their edge cases. Prefill takes
// it: same-call A/B on the H200 (session 31, two rounds), 0.977-1.005 of the exact step's time on the 22 bench cases
// (D=64 n=1024 causal 0.977, D=128 causal n=4096 / 16384 0.981 / 0.978).
template <bool Fast = false, typename O, typename V>
__device__ __forceinline__ void finalize(O& o, V& lse, const V& m, const V& l_shares, const scoring& sc) {
  using namespace kittens;
  V l, inv;
  lanes_row_sum<O>(l, l_shares);  // online_softmax keeps l in per-lane shares
  const auto rcp = [](float x) { return Fast ? __fdividef(1.f, x) : 1.f / x; };
  const auto lg2 = [](float x) { return Fast ? fast_log2(x) : log2f(x); };
  map(inv, l, [rcp](float x) { return x > 0.f ? rcp(x) : 0.f; });
  mul_row(o, o, inv);
  const float es = sc.exp_scale();
  map(lse, m, l, [es, lg2](float mx, float x) { return x > 0.f ? (mx * es + lg2(x)) * LN2 : -INFINITY; });
}

// A paged K/V tile's PIECES pieces: token_of(s) is piece s's first token, copy(s, page, row_in_page) issues its
// copies. The pages of two pieces are looked up before their copies, so those lookups are in flight together
// (a TMA issue is a memory barrier to the compiler: a lookup between two copies waits for the one before).
// Not all of a tile's at once: the producer keeps its registers few (setmaxnreg). block_size: an int, or a
// kittens::divisor (a multiply and a shift a piece instead of a division).
__device__ __forceinline__ int div_by(int n, int d) { return n / d; }
__device__ __forceinline__ int mod_by(int n, int d) { return n % d; }
__device__ __forceinline__ int div_by(int n, const kittens::divisor& d) { return d.div(n); }
__device__ __forceinline__ int mod_by(int n, const kittens::divisor& d) { return d.mod(n); }
template <int PIECES, typename BlockSize, typename TokenOf, typename Copy>
__device__ __forceinline__ void paged_pieces(const int* pages, const BlockSize& block_size, TokenOf token_of,
                                             Copy copy) {
  constexpr int LOOKUPS = PIECES % 2 == 0 ? 2 : 1;
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
