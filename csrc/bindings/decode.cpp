// torch.library CUDA implementation of tk::attn_decode (schema in tk_backend/attention.py): 16-bit caches, or e4m3
// ones (tk::attn_decode_fp8) with their descales, and over those an e4m3 query (tk::attn_decode_fp8_query).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include "../kernels/attention.h"
#include "checks.h"

namespace {

namespace chk = tk::checks;

void int32_contiguous(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  chk::same_device(t, q, name, "q");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}
void float_contiguous(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  chk::same_device(t, q, name, "q");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void attn_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& cache_seqlens, const at::Tensor& block_table, at::Tensor& work_items,
                 at::Tensor& cta_start, at::Tensor& partial_out, at::Tensor& partial_lse, int64_t chunk_tokens,
                 int64_t item_overhead, int64_t coarsen_levels, bool balanced, int64_t kv_tile, bool reuse_schedule,
                 double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
                 const std::optional<at::Tensor>& sinks, at::Tensor& out, at::Tensor& lse,
                 const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
                 const std::optional<at::Tensor>& v_descale) {
  chk::cuda(q, "q");
  // An e4m3 query (vLLM's, quantized for an fp8 cache) takes out's dtype for the checks that follow q's.
  const bool fp8_query = q.scalar_type() == at::kFloat8_e4m3fn;
  const at::Tensor& q16 = fp8_query ? out : q;
  chk::half_or_bf16(q16, fp8_query ? "out (for an e4m3 q)" : "q");
  chk::rank(q, 4, "q");
  chk::rank(k_cache, 4, "k_cache");
  chk::rank(v_cache, 4, "v_cache");
  const bool fp8 = chk::kv_caches(k_cache, v_cache, q16, "k_cache", "v_cache");
  if (!fp8) chk::no_descales(q_descale, k_descale, v_descale, k_cache, "k_cache");
  TORCH_CHECK(!fp8_query || fp8, "an e4m3 q needs fp8 caches, got k_cache of dtype ", k_cache.scalar_type());
  if (fp8_query) chk::same_device(out, q, "out", "q");
  else chk::like(out, q, "out", "q");
  const int64_t batch = q.size(0), q_len = q.size(1), hq = q.size(2), d = q.size(3), hkv = k_cache.size(2);
  chk::attention_head_dim(d);
  const int64_t tile_d = chk::attention_tile_dim(d);  // partials keep the tile's columns
  TORCH_CHECK(k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must be [blocks, ",
              "block_size, kv_heads, ", d, "]");
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "q heads (", hq, ") must be a multiple of kv heads (", hkv, ")");
  const int64_t group = hq / hkv, rows = q_len * group;
  TORCH_CHECK(rows <= 64, "the split decode kernel packs q_len x (q heads per kv head) <= 64 rows, got ", rows);
  TORCH_CHECK(k_cache.size(1) % 16 == 0, "block size must be a multiple of 16, got ", k_cache.size(1));
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(!fp8_query || (tile_d == d && !sinks.has_value()),
              "an e4m3 q is taken at head dims 64, 128 and 256 without sinks (widen it to out's dtype otherwise), got "
              "head dim ", d, sinks.has_value() ? " with sinks" : "");
  chk::tma_rows(q, "q");
  chk::tma_rows(k_cache, "k_cache");
  chk::tma_rows(v_cache, "v_cache");
  int32_contiguous(cache_seqlens, q, "cache_seqlens");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == batch &&
                  block_table.stride(1) == 1,
              "block_table must be int32 [batch, max_blocks] with contiguous rows");
  int32_contiguous(work_items, q, "work_items");
  int32_contiguous(cta_start, q, "cta_start");
  TORCH_CHECK(work_items.dim() == 2 && work_items.size(1) == 4, "work_items must be [max_items, 4]");
  const int64_t max_items = work_items.size(0);
  const int64_t ctas = cta_start.size(0) - 1;
  TORCH_CHECK(ctas >= 1, "cta_start must hold num_ctas + 1 >= 2 entries, got ", cta_start.size(0));
  if (balanced) {  // two partial slots a CTA; work_items holds the int64 stream offsets [batch + 1]
    TORCH_CHECK(ctas <= tk::DECODE_BALANCED_MAX_CTAS, "balanced decode runs on at most ",
                tk::DECODE_BALANCED_MAX_CTAS, " CTAs, got ", ctas);
    TORCH_CHECK(max_items >= 2 * ctas && 2 * max_items >= batch + 1, "balanced decode needs work_items of at least ",
                std::max(2 * ctas, (batch + 2) / 2), " rows, got ", max_items);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(work_items.data_ptr()) % 8 == 0,
                "balanced decode keeps int64 offsets in work_items: its data must be 8-byte aligned");
  } else {
    TORCH_CHECK(max_items % (batch * hkv) == 0, "work_items must hold batch x kv_heads x max_splits slots");
  }
  float_contiguous(partial_out, q, "partial_out");
  float_contiguous(partial_lse, q, "partial_lse");
  TORCH_CHECK(partial_out.numel() == max_items * rows * tile_d && partial_lse.numel() == max_items * rows,
              "partial_out / partial_lse must be [max_items, q_len, group, ", tile_d, "] / [max_items, q_len, group]");
  float_contiguous(lse, q, "lse");
  TORCH_CHECK(lse.numel() == batch * hq * q_len, "lse must be [batch, q_heads, q_len]");
  TORCH_CHECK(chunk_tokens > 0 && chunk_tokens % k_cache.size(1) == 0,
              "chunk_tokens must be a positive multiple of the block size, got ", chunk_tokens);
  TORCH_CHECK(item_overhead >= 0, "item_overhead must be >= 0, got ", item_overhead);
  TORCH_CHECK(coarsen_levels >= 0 && coarsen_levels <= tk::DECODE_MAX_COARSEN_LEVELS,
              "coarsen_levels must be in [0, ", tk::DECODE_MAX_COARSEN_LEVELS, "], got ", coarsen_levels);
  TORCH_CHECK(kv_tile == 128 || (kv_tile == 64 && tile_d == 128),
              "kv_tile must be 128, or 64 at head dims 72-128; got ", kv_tile, " at head dim ", d);
  const int64_t max_context = block_table.size(1) * k_cache.size(1);

  const c10::cuda::CUDAGuard guard(q.device());
  tk::attn_decode_problem p{};
  p.type = q16.scalar_type() == at::kBFloat16 ? tk::dtype::bf16 : tk::dtype::f16;
  p.head_dim = int(d);
  p.q = q.data_ptr();
  for (int i = 0; i < 3; i++) {
    p.q_strides[i] = q.stride(i);
    p.k_strides[i] = k_cache.stride(i);
    p.v_strides[i] = v_cache.stride(i);
    p.out_strides[i] = out.stride(i);
  }
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.cache_seqlens = cache_seqlens.data_ptr<int>();
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.stride(0);
  p.work_items = work_items.data_ptr<int>();
  p.cta_start = cta_start.data_ptr<int>();
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.batch = int(batch);
  p.q_len = int(q_len);
  p.hq = int(hq);
  p.hkv = int(hkv);
  p.num_blocks = int(k_cache.size(0));
  p.block_size = int(k_cache.size(1));
  p.max_items = int(max_items);
  p.max_splits = int(max_items / (batch * hkv));
  p.num_ctas = int(cta_start.size(0) - 1);
  p.chunk_tokens = int(chunk_tokens);
  p.item_overhead = int(item_overhead);
  p.coarsen_levels = int(coarsen_levels);
  p.balanced = balanced;
  p.reuse_schedule = reuse_schedule;
  p.kv_tile = int(kv_tile);
  p.max_context = int(max_context);
  p.causal = causal;
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  p.sinks = chk::attention_sinks(sinks, q, hq, d);
  if (!fp8) return tk::attn_decode(p, c10::cuda::getCurrentCUDAStream());
  const tk::attn_kv_descales descales = chk::kv_descales(q_descale, k_descale, v_descale, q, batch, hkv);
  if (fp8_query) return tk::attn_decode_fp8_query(p, descales, c10::cuda::getCurrentCUDAStream());
  tk::attn_decode_fp8(p, descales, c10::cuda::getCurrentCUDAStream());
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) { m.impl("attn_decode", &attn_decode); }
