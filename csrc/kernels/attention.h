// Attention launch interfaces (host): varlen / paged prefill.
#pragma once
#include <cuda_runtime.h>
#include "gemm.h"  // tk::dtype

namespace tk {

// Strides are in elements. q / o are [tokens, heads, head_dim]; k / v are either [tokens, heads, head_dim]
// (dense) or pages [num_blocks, block_size, heads, head_dim] (paged) with any strides but a unit last one.
struct attn_varlen_problem {
  dtype type;
  int head_dim;
  const void* q;
  long q_token_stride, q_head_stride;
  const void* k;
  const void* v;
  long k_strides[3], v_strides[3];  // dense: token, head, -; paged: block, token-in-block, head
  void* o;
  long o_token_stride, o_head_stride;
  float* lse;  // [hq, total_q], row stride lse_stride
  long lse_stride;
  const int* cu_seqlens_q;  // [batch + 1]
  const int* cu_seqlens_k;  // [batch + 1] or null (then seqused_k)
  const int* seqused_k;     // [batch] or null
  const int* block_table;   // [batch, bt_stride] or null (dense)
  long bt_stride;
  int batch, hq, hkv, total_q, total_k, num_blocks, block_size, max_seqlen_q;
  int max_seqlen_k;  // an upper bound on keys per sequence: sizes the L2-aware task groups only
  bool causal;
  int window_left, window_right;  // -1: unbounded
  float softmax_scale, softcap;   // softcap 0: off
  int* task_counter;  // when attn_varlen_claims: int32 [1], device, any value (zeroed on the stream); else unused
  const float* sinks;  // [hq] float32 attention-sink logits (tk::attn::apply_sinks), or null
};

void attn_varlen(const attn_varlen_problem& p, int num_sms, cudaStream_t stream);
// Whether attn_varlen's CTAs claim their tasks through p.task_counter (else it may be null).
bool attn_varlen_claims(const attn_varlen_problem& p);

// Split-KV paged decode over a work list (tk_backend/decode_plan.py: items (sequence, kv head, key start,
// key end), CTA c runs items [cta_start[c], cta_start[c + 1])), then the LSE merge into out / lse.
struct attn_decode_problem {
  dtype type;
  int head_dim;
  const void* q;  // [batch, q_len, hq, D]
  long q_strides[3];
  const void* k;  // pages [num_blocks, block_size, hkv, D]
  const void* v;
  long k_strides[3], v_strides[3];  // block, token-in-block, head
  const int* cache_seqlens;         // [batch]
  const int* block_table;           // [batch, bt_stride]
  long bt_stride;
  int* work_items;  // [max_items, 4], written by the decode kernel's CTAs (each works out its own range)
  int* cta_start;   // [num_ctas + 1], likewise
  float* partial_out;     // [max_items, q_len * group, D]
  float* partial_lse;     // [max_items, q_len * group]
  void* out;              // [batch, q_len, hq, D]
  long out_strides[3];
  float* lse;  // [batch, hq, q_len] contiguous
  int batch, q_len, hq, hkv, num_blocks, block_size, max_items, max_splits, num_ctas;
  int chunk_tokens, item_overhead, max_context;  // the plan (tk_backend/decode_plan.py)
  int coarsen_levels;  // the schedule may double chunk_tokens up to this many times (decode_plan: Coarsening)
  // Balanced mode (tk_backend/decode_balanced.py): shares of the step's keys instead of the plan's chunks;
  // chunk_tokens / coarsen_levels unused, work_items holds the stream offsets (int64 [batch + 1]), partial_out /
  // partial_lse two slots a CTA (max_items >= 2 * num_ctas).
  bool balanced;
  // work_items / cta_start already hold this call's schedule (an earlier call with the same plan, mode, window and
  // cache_seqlens wrote them: the step's first layer): the CTAs read their ranges instead of working them out.
  bool reuse_schedule;
  int kv_tile;  // keys a K/V tile at D=128: 64 or 128 (decode_plan.kv_tile); 128 at other head dims
  bool causal;
  int window_left, window_right;
  float softmax_scale, softcap;
  const float* sinks;  // [hq] float32 attention-sink logits, or null
};

void attn_decode(const attn_decode_problem& p, cudaStream_t stream);

// FP8 (e4m3) K/V caches hold x / scale; attention reads stored * descale. Each descale is float32 [batch, hkv]
// (flash-attn's k_descale / v_descale; a per-tensor scale expanded: strides 0) at element strides (sequence, kv
// head), or null for 1. q_descale multiplies q, as flash-attn defines it (null: 1).
struct attn_kv_descales {
  const float *q, *k, *v;
  long q_strides[2], k_strides[2], v_strides[2];
};

// attn_decode over e4m3 caches (p.k / p.v hold its bytes; p.type is q's dtype, and out's): the split kernel
// dequantizes each K/V tile to fp16 on chip (decode_fp8.cu).
void attn_decode_fp8(const attn_decode_problem& p, const attn_kv_descales& descales, cudaStream_t stream);
// ... with p.q holding e4m3 values (p.type is out's dtype), the query vLLM quantizes per tensor for an fp8 cache:
// Q K^T in e4m3 on the cache's own tiles, only V dequantized on chip (decode_fp8q.cu). Head dims 64, 128 and 256,
// no sinks; q_descale scales the scores like k_descale.
void attn_decode_fp8_query(const attn_decode_problem& p, const attn_kv_descales& descales, cudaStream_t stream);

// The pages of an e4m3 paged cache that a varlen batch reads, dequantized into an fp16 scratch cache of the same
// block layout (fp8_pages.cu) for the paged prefill kernel, which then runs in fp16 (q converted, out converted
// back). Sequence b (keys_b = seqused_k[b], else cu_seqlens_k[b + 1] - cu_seqlens_k[b]) reads its table's pages
// [first_b, ceil(keys_b / block_size)), first_b the first page that a left window leaves some query (else 0).
// The sequences' pages are packed: page j of b becomes scratch page offsets[b] + j - first_b, which
// scratch_table[b, j] names (columns outside [first_b, pages_b) name one of the sequence's pages: pages behind a
// window are read as anything finite, as the prefill kernel allows); pages past `capacity` (a caller's bound that
// did not hold) are not written and their columns name the last scratch page. Pages are copied per sequence, so
// pages that sequences share take each one's descales: the scratch holds k * k_descale[b, h] * q_descale[b, h] (the
// scores' factors) and v * v_descale[b, h]; rows past a sequence's last key are zeros.
struct fp8_pages_problem {
  int head_dim, hkv, block_size, batch;
  int max_pages;  // the scratch table's columns: ceil(max_seqlen_k / block_size), at most the table's
  int slots;      // the most pages one sequence reads: max_pages, or under a left window the most it can reach
  int capacity;   // scratch pages
  const void *k, *v;                // e4m3 pages [num_blocks, block_size, hkv, head_dim]
  long k_strides[3], v_strides[3];  // block, token-in-block, head (elements: bytes)
  const int* block_table;           // [batch, bt_stride], at least max_pages columns
  long bt_stride;
  const int* cu_seqlens_q;  // [batch + 1]: the queries, the last of each sequence's keys
  const int* cu_seqlens_k;  // [batch + 1], or null (then seqused_k)
  const int* seqused_k;     // [batch] or null
  int window_left;          // -1: unbounded
  attn_kv_descales descales;
  int* offsets;         // [batch]: written first (each sequence's first scratch page)
  void *k_out, *v_out;  // fp16 [capacity, block_size, hkv, head_dim] contiguous
  int* table_out;       // [batch, max_pages] contiguous
  int* seqused_out;     // [batch]: keys_b, clamped to max_pages * block_size (what the prefill kernel reads)
};
void fp8_pages_dequantize(const fp8_pages_problem& p, cudaStream_t stream);

constexpr int DECODE_MAX_COARSEN_LEVELS = 15;  // decode_plan.MAX_COARSEN_LEVELS
constexpr int DECODE_BALANCED_MAX_CTAS = 1024;  // balanced mode's schedule kernel: two CTAs a thread

}  // namespace tk
