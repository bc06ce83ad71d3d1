// torch.library CUDA implementations of tk::attn_varlen / tk::attn_varlen_out (schemas in tk_backend/attention.py).
// A paged e4m3 cache is first dequantized into an fp16 scratch cache of the pages the batch reads
// (tk::fp8_pages_dequantize), sized from host-known sizes (and total_k_bound), on which the paged kernel runs in fp16.
#include <ATen/ops/empty.h>
#include <algorithm>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include "../kernels/attention.h"
#include "checks.h"

namespace {

namespace chk = tk::checks;

const int* index_ptr(const std::optional<at::Tensor>& t, const at::Tensor& q, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kInt, name, " must be int32, got ", t->scalar_type());
  chk::same_device(*t, q, name, "q");
  TORCH_CHECK(t->stride(-1) == 1, name, " must be contiguous in its last dimension");
  return t->data_ptr<int>();
}

// The fp16 scratch cache of an e4m3 one (tk::fp8_pages_problem): ceil(max_seqlen_k / block_size) table columns (at
// most the table's, at least 1), as many pages a sequence (under a left window the most its queries reach) and in
// all at most what total_k_bound's keys fill (> 0: the caller's bound on the keys summed over sequences); the
// problem's k / v / block table / key counts are switched to the scratch's.
struct fp8_scratch {
  at::Tensor k, v, table, seqused, offsets;
};

fp8_scratch dequantize_pages(tk::attn_varlen_problem& p, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& block_table, int64_t max_seqlen_q,
                             int64_t max_seqlen_k, int64_t total_k_bound, const tk::attn_kv_descales& descales) {
  const int64_t bs = k.size(1), hkv = k.size(2), d = k.size(3);
  const int64_t max_pages = std::max<int64_t>(1, std::min<int64_t>((max_seqlen_k + bs - 1) / bs, block_table.size(1)));
  // A window's keys [L - lq - left, L) touch at most ceil((lq + left) / bs) + 1 pages.
  const int64_t slots = p.window_left >= 0 ? std::min(max_pages, (max_seqlen_q + p.window_left + bs - 1) / bs + 1)
                                           : max_pages;
  int64_t capacity = p.batch * slots;
  // A sequence's keys round up to whole pages: at most one page a sequence beyond the bound's.
  if (total_k_bound > 0) capacity = std::min(capacity, (total_k_bound + bs - 1) / bs + p.batch);
  capacity = std::max<int64_t>(capacity, 1);
  TORCH_CHECK(capacity <= INT32_MAX, "the fp8 scratch cache would hold ", capacity, " pages: pass total_k_bound");
  const auto half = q.options().dtype(at::kHalf);
  fp8_scratch s;
  s.k = at::empty({capacity, bs, hkv, d}, half);
  s.v = at::empty({capacity, bs, hkv, d}, half);
  s.table = at::empty({p.batch, max_pages}, q.options().dtype(at::kInt));
  s.seqused = at::empty({p.batch}, q.options().dtype(at::kInt));
  s.offsets = at::empty({p.batch}, q.options().dtype(at::kInt));
  tk::fp8_pages_problem f{};
  f.head_dim = int(d), f.hkv = int(hkv), f.block_size = int(bs), f.batch = p.batch;
  f.max_pages = int(max_pages), f.slots = int(slots), f.capacity = int(capacity);
  f.k = k.data_ptr(), f.v = v.data_ptr();
  for (int i = 0; i < 3; i++) f.k_strides[i] = k.stride(i), f.v_strides[i] = v.stride(i);
  f.block_table = p.block_table, f.bt_stride = p.bt_stride;
  f.cu_seqlens_q = p.cu_seqlens_q, f.cu_seqlens_k = p.cu_seqlens_k, f.seqused_k = p.seqused_k;
  f.window_left = p.window_left;
  f.descales = descales;
  f.offsets = s.offsets.data_ptr<int>();
  f.k_out = s.k.data_ptr(), f.v_out = s.v.data_ptr();
  f.table_out = s.table.data_ptr<int>(), f.seqused_out = s.seqused.data_ptr<int>();
  tk::fp8_pages_dequantize(f, c10::cuda::getCurrentCUDAStream());
  p.type = tk::dtype::f16;
  p.k = s.k.data_ptr(), p.v = s.v.data_ptr();
  for (int i = 0; i < 3; i++) p.k_strides[i] = p.v_strides[i] = s.k.stride(i);
  p.block_table = f.table_out, p.bt_stride = max_pages, p.num_blocks = int(capacity);
  p.cu_seqlens_k = nullptr, p.seqused_k = f.seqused_out;
  return s;
}

void attn_varlen_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                     const std::optional<at::Tensor>& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
                     const std::optional<at::Tensor>& block_table, int64_t max_seqlen_q, int64_t max_seqlen_k,
                     double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
                     const std::optional<at::Tensor>& sinks, at::Tensor& out, at::Tensor& lse,
                     const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
                     const std::optional<at::Tensor>& v_descale, int64_t total_k_bound) {
  chk::cuda(q, "q");
  chk::half_or_bf16(q, "q");
  chk::rank(q, 3, "q");
  const bool fp8 = chk::kv_caches(k, v, q, "k", "v");
  if (!fp8) chk::no_descales(q_descale, k_descale, v_descale, k, "k");
  chk::like(out, q, "out", "q");
  const bool paged = block_table.has_value();
  TORCH_CHECK(!fp8 || paged, "fp8 k / v need a paged cache (block_table): the dense varlen path takes 16-bit k / v");
  chk::rank(k, paged ? 4 : 3, "k");
  chk::rank(v, paged ? 4 : 3, "v");
  const int64_t d = q.size(2);
  chk::attention_head_dim(d);
  TORCH_CHECK(k.size(-1) == d && v.size(-1) == d, "k and v must have head dim ", d);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape ", chk::shape(q), ", got ", chk::shape(out));
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
              "lse must be float32 [", q.size(1), ", ", q.size(0), "]");
  TORCH_CHECK(lse.stride(1) == 1, "lse must be contiguous in its last dimension");
  const int64_t hq = q.size(1), hkv = k.size(-2);
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "q heads (", hq, ") must be a multiple of k/v heads (", hkv, ")");
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 2, "cu_seqlens_q must be [batch + 1]");
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK(cu_seqlens_k.has_value() || seqused_k.has_value(), "one of cu_seqlens_k and seqused_k is needed");
  chk::tma_rows(q, "q");
  chk::tma_rows(k, "k");
  chk::tma_rows(v, "v");
  chk::tma_rows(out, "out");

  const c10::cuda::CUDAGuard guard(q.device());
  tk::attn_varlen_problem p{};
  p.type = q.scalar_type() == at::kBFloat16 ? tk::dtype::bf16 : tk::dtype::f16;
  p.head_dim = int(d);
  p.q = q.data_ptr();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  for (int i = 0; i < k.dim() - 1; i++) p.k_strides[i] = k.stride(i), p.v_strides[i] = v.stride(i);
  p.o = out.data_ptr();
  p.o_token_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.lse = lse.data_ptr<float>();
  p.lse_stride = lse.stride(0);
  p.cu_seqlens_q = index_ptr(cu_seqlens_q, q, "cu_seqlens_q");
  p.cu_seqlens_k = index_ptr(cu_seqlens_k, q, "cu_seqlens_k");
  p.seqused_k = index_ptr(seqused_k, q, "seqused_k");
  p.block_table = index_ptr(block_table, q, "block_table");
  p.bt_stride = paged ? block_table->stride(0) : 0;
  p.batch = int(batch);
  p.hq = int(hq);
  p.hkv = int(hkv);
  p.total_q = int(q.size(0));
  p.total_k = paged ? 0 : int(k.size(0));
  p.num_blocks = paged ? int(k.size(0)) : 0;
  p.block_size = paged ? int(k.size(1)) : 0;
  TORCH_CHECK(!paged || (p.block_size % 16 == 0), "block size must be a multiple of 16, got ", p.block_size);
  p.max_seqlen_q = int(max_seqlen_q);
  p.causal = causal;
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  p.max_seqlen_k = int(std::max<int64_t>(max_seqlen_k, 1));
  p.sinks = chk::attention_sinks(sinks, q, hq, d);
  // Over an fp8 cache the kernel runs in fp16 on the scratch cache: a bf16 q is converted (saturated; bf16's
  // 8-bit values are exact in fp16 inside its range) and so is the output back. The scratch tensors stay alive
  // until the launches are queued (the caching allocator keeps them for this stream).
  fp8_scratch scratch;
  at::Tensor q16, out16;
  if (fp8) {
    const tk::attn_kv_descales descales = chk::kv_descales(q_descale, k_descale, v_descale, q, batch, hkv);
    scratch = dequantize_pages(p, q, k, v, *block_table, max_seqlen_q, max_seqlen_k, total_k_bound, descales);
    if (q.scalar_type() != at::kHalf) {
      q16 = q.clamp(-65504., 65504.).to(at::kHalf);
      out16 = at::empty(out.sizes(), q16.options());
      p.q = q16.data_ptr(), p.q_token_stride = q16.stride(0), p.q_head_stride = q16.stride(1);
      p.o = out16.data_ptr(), p.o_token_stride = out16.stride(0), p.o_head_stride = out16.stride(1);
    }
  }
  at::Tensor task_counter;
  if (tk::attn_varlen_claims(p)) {
    task_counter = at::empty({1}, q.options().dtype(at::kInt));
    p.task_counter = task_counter.data_ptr<int>();
  }
  tk::attn_varlen(p, chk::sm_count(q.get_device()), c10::cuda::getCurrentCUDAStream());
  if (out16.defined()) out.copy_(out16);
}

std::tuple<at::Tensor, at::Tensor> attn_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& cu_seqlens_q,
                                               const std::optional<at::Tensor>& cu_seqlens_k,
                                               const std::optional<at::Tensor>& seqused_k,
                                               const std::optional<at::Tensor>& block_table, int64_t max_seqlen_q,
                                               int64_t max_seqlen_k, double softmax_scale, bool causal,
                                               int64_t window_left, int64_t window_right, double softcap,
                                               const std::optional<at::Tensor>& sinks,
                                               const std::optional<at::Tensor>& q_descale,
                                               const std::optional<at::Tensor>& k_descale,
                                               const std::optional<at::Tensor>& v_descale,
                                               int64_t total_k_bound) {
  chk::rank(q, 3, "q");
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  attn_varlen_out(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_left, window_right, softcap, sinks, out, lse, q_descale, k_descale,
                  v_descale, total_k_bound);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("attn_varlen", &attn_varlen);
  m.impl("attn_varlen_out", &attn_varlen_out);
}
