// Prefill's kernel variants in one table: per head dim x mask x length class, every choice the kernel makes at
// compile time, by name. `select_variant` picks a launch's row; `policy_of` gives its policy. Why each choice is
// what it is: docs/findings/prefill.md (the #anchors below are its entries).
#pragma once
#include "../../kittens/kittens.cuh"
#include "../attention.h"
#include "../attention/variants.cuh"

namespace tk::prefill {

using kittens::lcsf::task_walk;

// How a consumer runs a K/V tile.
enum class tile_order {
  // S_j = Q K_j^T and the previous tile's P V are issued together, and S_j's softmax overlaps that P V.
  overlapped,
  // S_j, its softmax and its P V in turn; the other consumers' products keep the tensor cores busy meanwhile
  // (three consumers at D=128 have 160 registers a thread: too few to hold S_j beside P_{j-1}).
  serial,
};
// How a K/V tile sits in the input ring.
enum class kv_ring {
  paired,     // K_j and V_j in one slot, freed together
  staggered,  // K_j and V_j in slots of their own (lcsf's staggered pairs): K_j goes back once S_j has run
};
// The order of a CTA's strided tasks (within L2 groups of heads, latest query block first).
enum class task_order {
  grouped,  // the stride as it falls
  // Under a causal mask odd waves run reversed (zigzag), so a CTA's long and short tasks alternate; without a mask
  // each full wave turns by heads_per_group places, so the ragged first blocks spread over the CTAs.
  turned_waves,
};
// A task's first tile's softmax.
enum class first_tile {
  exact,   // the exact step
  fresh,   // the exact step without the old max's rescale (no row has seen a key)
  seeded,  // the fast step against a guess at each row's max (its first 16 columns'); exact where that fails
};

struct policy {
  int head_dim;
  int consumers;  // warpgroups of 64 query rows: 192- or 128-row query blocks
  int kv_rows;    // keys a K/V tile
  int stages;     // K/V ring slots
  tile_order order;
  task_walk walk;
  kv_ring ring;
  task_order tasks;
  // The producer loads each consumer's queries for the next task once the consumer has run its last S of this one
  // (into buffers of their own; the output gets its own staging buffer). Otherwise a consumer loads its queries as
  // it starts a task and stages the output in their buffer. (#prefill-q-ahead64)
  bool queries_ahead;
  bool warp_epilogue;    // each warp stores its own 16 output rows and frees its part of the queries (#warp-epi)
  bool mask_once;        // which tiles need the mask is worked out once a task, not tested a tile (#prefill-mask-once)
  bool skip_hidden;      // a warp skips the softmax of a tile that hides every key from its rows (#prefill-hidden-skip)
  bool trims;            // a consumer computes only the tiles up to the last its rows see (#d64-trims)
  bool half_last;        // a consumer's last tile on its first kv_rows / 2 keys where its rows see no more (#half-last)
  // serial: a consumer's first tile on its last kv_rows / 2 keys where its rows see none of the first half, its last
  // tile on its first half where they see none of the second: its tiles cover the keys it sees to the half tile
  // (#window-tiles)
  bool half_ends = false;
  bool softcap;          // the softcap's code is compiled in (else launches have softcap 0)
  bool page_divisor;     // paged loads divide by the page size with a kittens::divisor (#prefill-paged-div128)
  bool lazy_rescale;     // the running max moves only past tk::attn::RESCALE_THRESHOLD (#prefill-lazy-rescale)
  bool fast_softmax;     // a task's later tiles take the fast softmax step (#prefill-softmax-fast)
  bool fast_needs_seen;  // online_softmax's fast_needs_seen (the serial kernel's registers do without it)
  first_tile first;
  bool sinks = false;    // each row's softmax takes its head's attention-sink logit (tk::attn::apply_sinks)
  // The head dim is below the tile's (a multiple of 8 between the tile sizes): its global layouts' columns are
  // run-time sizes, so TMA zero-fills the tile's extra columns on loads and clips them on stores.
  bool ragged_head_dim = false;
};

using tk::attn::with_ragged_head_dim, tk::attn::with_sinks;

// ---- the table

// D=64: three overlapped consumers, the producer feeds each task, queries ahead, trims, half last tiles.
inline constexpr policy d64{
    .head_dim = 64, .consumers = 3, .kv_rows = 128, .stages = 4, .order = tile_order::overlapped,
    .walk = task_walk::fed, .ring = kv_ring::paired, .tasks = task_order::turned_waves, .queries_ahead = true,
    .warp_epilogue = true, .mask_once = true, .skip_hidden = true, .trims = true, .half_last = true,
    .softcap = false, .page_divisor = false, .lazy_rescale = true, .fast_softmax = true, .fast_needs_seen = true,
    .first = first_tile::seeded};
// D=64 with a softcap: beside the softcap's code the seeded first tile spilled, so the fresh exact one (#seeded-first).
inline constexpr policy d64_softcap = [] {
  policy p = d64;
  p.softcap = true;
  p.half_last = false;
  p.first = first_tile::fresh;
  return p;
}();
// D=64 under a small sliding window (select_variant: D64_WINDOW_KEYS): three serial consumers, each on its own tiles
// (seen_lo / seen_hi) with half tiles at both ends of them, so each computes the three half tiles its 64 rows see
// where the overlapped kernel's consumers run from the task's first tile (a task at gpt-oss's (127, 0): 4.4
// consumer tiles, not 6.6); queries ahead, the fresh first tile (#window-tiles).
inline constexpr policy d64_window{
    .head_dim = 64, .consumers = 3, .kv_rows = 128, .stages = 4, .order = tile_order::serial,
    .walk = task_walk::fed, .ring = kv_ring::paired, .tasks = task_order::grouped, .queries_ahead = true,
    .warp_epilogue = true, .mask_once = true, .skip_hidden = false, .trims = false, .half_last = false,
    .half_ends = true, .softcap = false, .page_divisor = false, .lazy_rescale = true, .fast_softmax = true,
    .fast_needs_seen = true, .first = first_tile::fresh};
// D=128 over <= 1024 keys: two overlapped consumers on a staggered ring (FA3's hdim-128 layout), queries ahead
// (#prefill-c2-stagger-ahead).
inline constexpr policy d128_short{
    .head_dim = 128, .consumers = 2, .kv_rows = 128, .stages = 4, .order = tile_order::overlapped,
    .walk = task_walk::prefetched, .ring = kv_ring::staggered, .tasks = task_order::grouped, .queries_ahead = true,
    .warp_epilogue = false, .mask_once = true, .skip_hidden = false, .trims = false, .half_last = false,
    .softcap = true, .page_divisor = true, .lazy_rescale = true, .fast_softmax = true, .fast_needs_seen = true,
    .first = first_tile::exact};
// D=128 over > 1024 keys, full mask: three serial consumers (ThunderKittens' H100 forward), the exact softmax
// (#prefill-three, #prefill-serial-fast).
inline constexpr policy d128_long{
    .head_dim = 128, .consumers = 3, .kv_rows = 128, .stages = 2, .order = tile_order::serial,
    .walk = task_walk::prefetched, .ring = kv_ring::paired, .tasks = task_order::grouped, .queries_ahead = false,
    .warp_epilogue = false, .mask_once = false, .skip_hidden = false, .trims = false, .half_last = false,
    .softcap = true, .page_divisor = true, .lazy_rescale = true, .fast_softmax = false, .fast_needs_seen = false,
    .first = first_tile::exact};
// ... causal (paged K/V): the fast softmax pays under causal masks only.
inline constexpr policy d128_long_causal = [] {
  policy p = d128_long;
  p.fast_softmax = true;
  return p;
}();
// ... causal over dense K/V: claimed tasks (#prefill-causal-claims); eager rescaling (the lazy branch spilled at
// 160 registers).
inline constexpr policy d128_long_causal_claimed = [] {
  policy p = d128_long_causal;
  p.walk = task_walk::claimed;
  p.lazy_rescale = false;
  return p;
}();
// D=256, full mask: two overlapped consumers on a staggered ring of 80-key tiles, the exact softmax.
inline constexpr policy d256{
    .head_dim = 256, .consumers = 2, .kv_rows = 80, .stages = 4, .order = tile_order::overlapped,
    .walk = task_walk::strided, .ring = kv_ring::staggered, .tasks = task_order::grouped, .queries_ahead = false,
    .warp_epilogue = false, .mask_once = false, .skip_hidden = false, .trims = false, .half_last = false,
    .softcap = true, .page_divisor = false, .lazy_rescale = true, .fast_softmax = false, .fast_needs_seen = true,
    .first = first_tile::exact};
// D=256, causal: claimed tasks.
inline constexpr policy d256_causal = [] {
  policy p = d256;
  p.walk = task_walk::claimed;
  return p;
}();

// ---- selection

enum class variant { d64, d64_softcap, d64_window, d128_short, d128_long, d128_long_causal, d128_long_causal_claimed,
                     d256, d256_causal };

// D=128 switches from two overlapped consumers to three serial ones past this many keys.
inline constexpr int D128_SHORT_KEYS = 1024;
// D=64 without a softcap runs d64_window where each query sees at most this many keys besides its own (a left window
// plus, without a causal mask, a right one): a 64-row consumer then sees at most 192 keys, three half tiles.
inline constexpr int D64_WINDOW_KEYS = 128;

// Whether a query's keys are bounded on both sides with at most D64_WINDOW_KEYS of them besides its own.
inline bool small_window(const attn_varlen_problem& p) {
  const int right = p.causal ? 0 : p.window_right;  // a causal mask ends every row's keys at its own
  return p.window_left >= 0 && right >= 0 && p.window_left <= D64_WINDOW_KEYS - right;
}

using tk::attn::tile_head_dim;

inline variant select_variant(const attn_varlen_problem& p) {
  switch (tile_head_dim(p.head_dim)) {
    case 64:
      if (p.softcap > 0.f) return variant::d64_softcap;
      return small_window(p) ? variant::d64_window : variant::d64;
    case 128:
      if (p.max_seqlen_k <= D128_SHORT_KEYS) return variant::d128_short;
      if (!p.causal) return variant::d128_long;
      return p.block_table != nullptr ? variant::d128_long_causal : variant::d128_long_causal_claimed;
    default: return p.causal ? variant::d256_causal : variant::d256;
  }
}

constexpr policy policy_of(variant v) {
  switch (v) {
    case variant::d64: return d64;
    case variant::d64_softcap: return d64_softcap;
    case variant::d64_window: return d64_window;
    case variant::d128_short: return d128_short;
    case variant::d128_long: return d128_long;
    case variant::d128_long_causal: return d128_long_causal;
    case variant::d128_long_causal_claimed: return d128_long_causal_claimed;
    case variant::d256: return d256;
    default: return d256_causal;
  }
}

}  // namespace tk::prefill
