// The online softmax over one score tile, and the finalize that turns its running sums into the output and LSE.
// Shared by prefill and decode. The variants (lazy rescaling, the fast path, fresh and seeded first tiles) are
// described in docs/findings/prefill.md.
#pragma once
#include <cfloat>
#include "../../kittens/kittens.cuh"

namespace tk::attn {

inline constexpr float LOG2E = 1.4426950408889634f;
inline constexpr float LN2 = 0.6931471805599453f;

// How raw q.k scores become exp2 arguments: times scale * log2(e), or with a softcap
// softcap * tanh(score * scale / softcap) first (then times log2(e)).
struct scoring {
  float scale_log2, softcap;
  __device__ __forceinline__ float exp_scale() const { return softcap > 0.f ? LOG2E : scale_log2; }
};

// Lazy rescaling (as FlashAttention-4 does): the running max moves only when a tile's max passes it by more than
// this many powers of two, so probabilities stay <= 2^8 and most tiles skip the output's rescale.
inline constexpr float RESCALE_THRESHOLD = 8.f;
// The fast path's bound on a lane's share of a row's sum: P <= 2^15 stays exact enough in fp32 sums and bf16 P.
inline constexpr float FAST_SHARE_LIMIT = 32768.f;
// A seeded first tile guesses each row's max from its first SEED_BLOCKS 16-column blocks.
inline constexpr int SEED_BLOCKS = 1;

// How one online_softmax step runs. Every field is named where a kernel sets it.
struct softmax_step {
  // The running max moves only past RESCALE_THRESHOLD; the step's result says whether any row's rescale is not 1.
  bool lazy_rescale = false;
  // The row slots of the tile that hold live rows (1: only rows lane / 4, the first 8 of each warp's 16, as
  // decode's packed queries of a small group); the others are left as they are, so their scores must be finite.
  unsigned row_slots = ~0u;
  // exp2 against the running max as it stands, without the tile's own row max; the exact step (after
  // `recompute` puts the raw scores back) only where a lane's share of a row's sum passes FAST_SHARE_LIMIT.
  bool fast = false;
  // With fast: a row that has seen no key yet sends the warp to the exact step at once (one vote a tile); without
  // it such a row fails the share test after the recompute (fewer live registers: the serial kernel's choice).
  bool fast_needs_seen = false;
  // The task's first tile: no row has seen a key (m = -inf, l = 0, output 0), so there is no old max to rescale
  // from. With fast, the step is seeded: its guess at each row's max is the max of the first SEED_BLOCKS blocks.
  bool fresh = false;
};

// One online-softmax step on a warp's score tile `att` whose first row / column are row0 / col0: masks what `vis`
// hides (only where `masked()` says the tile needs it), folds the tile into the running max m (score units; -inf for
// a row that has seen no key) and sum l (per-lane shares, combined in finalize), turns att into unnormalised
// probabilities and leaves in `rescale` the factor the output accumulated so far must take. Returns whether the
// output must take it (always true without lazy_rescale; false where fast or fresh steps leave it at 1).
// `recompute(att)`: S = Q K^T again, its wait included. `group_all(pred)`: whether pred holds in every warp that
// issues the recompute's product (a warpgroup: all of its warps must issue it, or none).
template <softmax_step Step, typename S, typename V, typename Visibility, typename Masked, typename Recompute,
          typename GroupAll>
__device__ __forceinline__ bool online_softmax(S& att, V& m, V& l, V& rescale, const scoring& sc,
                                               const Visibility& vis, int row0, int col0, Masked masked,
                                               Recompute recompute, GroupAll group_all) {
  using namespace kittens;
  constexpr unsigned RowSlots = Step.row_slots;
  const float es = sc.exp_scale();
  const auto prepare = [&] {
    if (sc.softcap > 0.f) {
      // cap * tanh(y) = cap - 2 cap / (1 + 2^(2 log2(e) y)): one ex2 and one rcp a score (tanhf's expansion
      // spilled). Saturates cleanly at +-cap; the absolute error near 0 is ~1e-7 cap, far below bf16's.
      const float k = 2.f * sc.scale_log2 / sc.softcap, cap = sc.softcap, two_cap = 2.f * sc.softcap;
      map(att, att, [k, cap, two_cap](float x) { return cap - __fdividef(two_cap, 1.f + fast_exp2(x * k)); });
    }
    if (masked()) {
      const auto keys = [&vis](int row, int& lo, int& hi) { vis.keys(row, lo, hi); };
      // Without a window's left edge no row's keys start inside the tile: one compare an element, not two.
      if (vis.left >= 0) mask_cols<RowSlots>(att, att, row0, col0, keys, -INFINITY);
      else mask_cols<RowSlots, false>(att, att, row0, col0, keys, -INFINITY);
    }
  };
  prepare();
  if constexpr (Step.fast) {
    if constexpr (Step.fresh) row_max_leading<SEED_BLOCKS, RowSlots>(m, att, m);  // the guess (m was -inf)
    bool seen = true;  // every row of the warp has seen a key (a task's first tile: none has)
#pragma unroll
    for (int b = 0; b < V::blocks; b++)
#pragma unroll
      for (int i = 0; i < V::per_lane; i++) seen &= m.data[b][i] != -INFINITY;
    seen = !Step.fast_needs_seen || __all_sync(0xffffffffu, seen);  // else a row's -inf base fails the test below
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
    // A warp that skipped the fast path gets its own scores back from the group's recompute.
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
  bool moved = false;  // lazy: whether any of this lane's rows moved its max
  if constexpr (Step.fresh) {  // no old max to rescale from: l and the output stay as they are (0); a seed is <= m_new
    map(base, m_new, [es](float x) { return x == -INFINITY ? 0.f : x * es; });  // a row still masked: 0
    copy(m, m_new);
  } else if constexpr (Step.lazy_rescale) {
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
  if constexpr (!Step.fresh) map(l, l, rescale, [](float x, float r) { return x * r; });
  row_sum_share<RowSlots>(l, att, l);  // l in shares: the lanes of a row are combined once, in finalize
  if constexpr (Step.fresh) return false;  // the output is 0: it needs no rescale
  else if constexpr (Step.lazy_rescale) return __any_sync(0xffffffffu, moved);
  else return true;
}

// Without the fast path (nothing to recompute), masking the tiles vis.partial says need it.
template <softmax_step Step, typename S, typename V, typename Visibility>
__device__ __forceinline__ bool online_softmax(S& att, V& m, V& l, V& rescale, const scoring& sc,
                                               const Visibility& vis, int row0, int col0) {
  static_assert(!Step.fast, "the fast path needs a recompute");
  return online_softmax<Step>(
      att, m, l, rescale, sc, vis, row0, col0, [&] { return vis.partial(row0, S::rows, col0, S::cols); },
      [](S&) {}, [](bool) { return true; });
}

// finalize's reciprocal and log2: IEEE, or single approximate instructions (MUFU.RCP / MUFU.LG2, ~1 ulp), which are
// exact enough because a row that saw a key has l >= 1 (its max key's probability is at least 1).
enum class finalize_math { ieee, approximate };

// o /= l, and the natural-log LSE of each row (-inf and o = 0 for a row that saw no key).
template <finalize_math Math = finalize_math::ieee, typename O, typename V>
__device__ __forceinline__ void finalize(O& o, V& lse, const V& m, const V& l_shares, const scoring& sc) {
  using namespace kittens;
  constexpr bool approximate = Math == finalize_math::approximate;
  V l, inv;
  lanes_row_sum<O>(l, l_shares);  // online_softmax keeps l in per-lane shares
  const auto rcp = [](float x) { return approximate ? __fdividef(1.f, x) : 1.f / x; };
  const auto lg2 = [](float x) { return approximate ? fast_log2(x) : log2f(x); };
  map(inv, l, [rcp](float x) { return x > 0.f ? rcp(x) : 0.f; });
  mul_row(o, o, inv);
  const float es = sc.exp_scale();
  map(lse, m, l, [es, lg2](float mx, float x) { return x > 0.f ? (mx * es + lg2(x)) * LN2 : -INFINITY; });
}

// Attention sinks (gpt-oss): a learned logit per query head that joins its rows' softmax denominators and attends to
// nothing. A finalized row (output o normalised without the sink, natural-log lse) becomes, with sink s:
// o * exp(lse) / (exp(lse) + exp(s)) = o * sigmoid(lse - s), and its lse logaddexp(lse, s). A row that saw no key
// keeps o = 0 and takes lse = s. exp(s - lse) may overflow to inf: the factor is then 0, as it should be.
__device__ __forceinline__ float sink_factor(float lse, float sink) {
  return lse == -INFINITY ? 0.f : __fdividef(1.f, 1.f + __expf(sink - lse));
}
__device__ __forceinline__ float lse_with_sink(float lse, float sink) {
  return lse == -INFINITY ? sink : fmaxf(lse, sink) + __logf(1.f + __expf(-fabsf(lse - sink)));
}
template <typename O, typename V>
__device__ __forceinline__ void apply_sinks(O& o, V& lse, const V& sink) {
  using namespace kittens;
  V factor;
  map(factor, lse, sink, [](float a, float s) { return sink_factor(a, s); });
  mul_row(o, o, factor);
  map(lse, lse, sink, [](float a, float s) { return lse_with_sink(a, s); });
}

}  // namespace tk::attn
