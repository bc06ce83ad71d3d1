// Decode's kernel variants in one table: per head dim (and, at D=128, per K/V tile), the tile and ring each runs.
// Why: docs/findings/decode.md.
#pragma once
#include "../attention.h"
#include "../attention/variants.cuh"

namespace tk::decode {

struct policy {
  int head_dim;
  int kv_rows;         // keys a K/V tile
  int stages;          // K/V ring slots
  bool sinks = false;  // rows of whole items take their head's attention-sink logit (tk::attn::apply_sinks)
  // The head dim is below the tile's: the caches' columns are run-time sizes (TMA zero-fills the tile's extra
  // columns), queries load and outputs store only the head dim's columns; partials keep the tile's.
  bool ragged_head_dim = false;
  // The caches hold float8_e4m3fn: the ring holds their 1-byte tiles, which the producer warpgroup's other warps
  // convert into `converted_stages` fp16 tiles (lcsf's converted ring, dequant.cuh) for the consumer, whose queries
  // load as fp16 too; the descales scale the scores and the output rows.
  bool fp8_kv = false;
  int converted_stages = 0;
  // (with fp8_kv) q holds e4m3 values (vLLM's query, quantized per tensor for an fp8 cache): S = Q K^T is an e4m3
  // product on the raw ring's K tiles, and only V converts (its product with P stays fp16).
  bool fp8_q = false;
  // Page ids the producer looks up together before their pieces' copies (a TMA issue orders the loads before it):
  // a stage's lookups take kv_rows / 16 / page_lookups round trips. D=64's 32 KB stages are half D=128's bytes a
  // piece, so its lookups go four at a time (eight spilled: docs/findings/decode.md#decode-d64-lookups).
  int page_lookups = 2;
};
using tk::attn::tile_head_dim, tk::attn::with_ragged_head_dim, tk::attn::with_sinks;
// fp8 tiles are half the bytes: the ring takes `stages` of them in what the converted ring leaves of shared memory.
// The consumer holds two converted stages (K_j, and V_{j-1} until P V is done), so three let the converting warps
// work one tile ahead.
constexpr policy with_fp8_kv(policy p, int stages, int converted_stages = 3) {
  p.fp8_kv = true;
  p.stages = stages;
  p.converted_stages = converted_stages;
  return p;
}
// An e4m3 query: the converted ring holds V only, so it fits more stages of both rings.
constexpr policy with_fp8_qk(policy p, int stages, int converted_stages) {
  p = with_fp8_kv(p, stages, converted_stages);
  p.fp8_q = true;
  return p;
}
inline constexpr policy d64{.head_dim = 64, .kv_rows = 128, .stages = 6, .page_lookups = 4};
inline constexpr policy d128{.head_dim = 128, .kv_rows = 128, .stages = 3};
// 64-key tiles in 6 stages hold the ring bytes of 128 x 3 but free a stage twice as often: short items and balanced
// pieces stream faster, long ones slower (decode_plan.kv_tile picks: attn_decode_problem::kv_tile).
inline constexpr policy d128_kv64{.head_dim = 128, .kv_rows = 64, .stages = 6};
inline constexpr policy d256{.head_dim = 256, .kv_rows = 48, .stages = 3};
// Over FP8 caches (decode_fp8.cu): the same tiles, in 6 raw stages beside 3 converted ones. D=128 takes 64-key tiles
// at every plan: three converted 128-key stages and a raw one do not fit. D=256 takes 32-key tiles in 4 raw stages:
// 48-key ones fit only 2, and left the self-scheduling kernel (3.5 KB of static shared memory) over the 227 KB.
inline constexpr policy d64_fp8 = with_fp8_kv(d64, 6);
inline constexpr policy d128_kv64_fp8 = with_fp8_kv(d128_kv64, 6);
inline constexpr policy d256_fp8 = with_fp8_kv({.head_dim = 256, .kv_rows = 32, .stages = 4}, 4);
// With an e4m3 query (decode_fp8q.cu): 1-byte raw stages, 16-bit V stages and a 1-byte query tile; at D=128 both
// tiles, as at 16 bits (128-key tiles: 5-6% faster on long items, docs/findings/decode.md#decode-fp8-query).
inline constexpr policy d64_fp8q = with_fp8_qk(d64, 8, 4);
inline constexpr policy d128_kv64_fp8q = with_fp8_qk(d128_kv64, 8, 4);
// 128-key tiles (decode_plan.kv_tile's choice for long items, as at 16 bits): 3 raw + 3 V stages.
inline constexpr policy d128_fp8q = with_fp8_qk(d128, 3, 3);
inline constexpr policy d256_fp8q = with_fp8_qk(d256, 5, 3);

// Where a CTA's range of the static schedule comes from. A kernel that can work it out carries the scheduling code,
// whose presence alone slowed the other modes, so each mode has its own kernel.
enum class schedule_source {
  reads,  // direct mode (a CTA a slot), balanced mode (build_balanced's), or an earlier layer's of the step
  self,   // each CTA works out its own range from cache_seqlens (self_schedule)
};

enum class variant { d64, d128, d128_kv64, d256 };

inline variant select_variant(const attn_decode_problem& p) {
  switch (tile_head_dim(p.head_dim)) {
    case 64: return variant::d64;
    case 128: return p.kv_tile == 64 ? variant::d128_kv64 : variant::d128;
    default: return variant::d256;
  }
}

}  // namespace tk::decode
