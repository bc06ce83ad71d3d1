// torch.library CUDA implementations of tk::attn_varlen / tk::attn_varlen_out (schemas in tk_backend/attention.py).
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

void attn_varlen_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                     const std::optional<at::Tensor>& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
                     const std::optional<at::Tensor>& block_table, int64_t max_seqlen_q, int64_t max_seqlen_k,
                     double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
                     const std::optional<at::Tensor>& sinks, at::Tensor& out, at::Tensor& lse,
                     const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
                     const std::optional<at::Tensor>& v_descale) {
  chk::cuda(q, "q");
  chk::half_or_bf16(q, "q");
  chk::rank(q, 3, "q");
  const bool fp8 = chk::kv_caches(k, v, q, "k", "v");
  if (!fp8) chk::no_descales(q_descale, k_descale, v_descale, k, "k");
  chk::like(out, q, "out", "q");
  const bool paged = block_table.has_value();
  TORCH_CHECK(!fp8 || paged, "fp8 k / v need a paged cache (block_table): the dense varlen path takes 16-bit k / v");
  TORCH_CHECK(!fp8, "prefill over an fp8 KV cache is not supported yet (fp8 caches serve decode only; the "
              "dequantize-then-prefill path waits for its GPU checks in ab/fp8-prefill-scratch.patch)");
  chk::rank(k, paged ? 4 : 3, "k");
  chk::rank(v, paged ? 4 : 3, "v");
  const int64_t d = q.size(2);
  chk::attention_head_dim(d);
  TORCH_CHECK(k.size(-1) == d && v.size(-1) == d, "k and v must have head dim ", d);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ", out.sizes());
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
  at::Tensor task_counter;
  if (tk::attn_varlen_claims(p)) {
    task_counter = at::empty({1}, q.options().dtype(at::kInt));
    p.task_counter = task_counter.data_ptr<int>();
  }
  tk::attn_varlen(p, chk::sm_count(q.get_device()), c10::cuda::getCurrentCUDAStream());
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
                                               const std::optional<at::Tensor>& v_descale) {
  chk::rank(q, 3, "q");
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  attn_varlen_out(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_left, window_right, softcap, sinks, out, lse, q_descale, k_descale,
                  v_descale);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("attn_varlen", &attn_varlen);
  m.impl("attn_varlen_out", &attn_varlen_out);
}
