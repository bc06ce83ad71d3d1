// torch.library CUDA implementations of tk::based_prefill / tk::based_step (schemas in tk_backend/based.py).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include "../kernels/based.h"
#include "checks.h"

namespace {

namespace chk = tk::checks;

constexpr int64_t FEATURE_DIM = 16;

void head_dims(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.size(-1) == FEATURE_DIM && k.size(-1) == FEATURE_DIM, "q and k must have feature dim ", FEATURE_DIM,
              ", got ", q.size(-1), " and ", k.size(-1));
  const int64_t dv = v.size(-1);
  TORCH_CHECK(dv % 64 == 0 && dv >= 64 && dv <= 256, "v head dim must be 64, 128, 192 or 256, got ", dv);
}

// One state tensor: float32, contiguous, [B, H, rows..., Dv + 1] on q's device.
float* state_ptr(const at::Tensor& t, const at::Tensor& q, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  chk::same_device(t, q, name, "q");
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", chk::shape(shape), ", got ", chk::shape(t));
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  return t.data_ptr<float>();
}

tk::based_state state_of(const std::optional<at::Tensor>& zeroth, const std::optional<at::Tensor>& first,
                         const std::optional<at::Tensor>& second, const at::Tensor& q, int64_t b, int64_t h,
                         int64_t w, const char* names[3]) {
  const bool any = zeroth.has_value() || first.has_value() || second.has_value();
  if (!any) return {nullptr, nullptr, nullptr};
  TORCH_CHECK(zeroth.has_value() && first.has_value() && second.has_value(), names[0], ", ", names[1], " and ",
              names[2], " must be given together");
  return {state_ptr(*zeroth, q, {b, h, w}, names[0]), state_ptr(*first, q, {b, h, FEATURE_DIM, w}, names[1]),
          state_ptr(*second, q, {b, h, FEATURE_DIM, FEATURE_DIM, w}, names[2])};
}

at::Tensor based_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool use_norm,
                         double eps, const std::optional<at::Tensor>& initial_zeroth,
                         const std::optional<at::Tensor>& initial_first, const std::optional<at::Tensor>& initial_second,
                         const std::optional<at::Tensor>& final_zeroth, const std::optional<at::Tensor>& final_first,
                         const std::optional<at::Tensor>& final_second) {
  chk::cuda(q, "q");
  chk::half_or_bf16(q, "q");
  chk::rank(q, 4, "q");
  chk::rank(k, 4, "k");
  chk::rank(v, 4, "v");
  chk::like(k, q, "k", "q");
  chk::like(v, q, "v", "q");
  head_dims(q, k, v);
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), dv = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape ", chk::shape(q), ", got ", chk::shape(k));
  TORCH_CHECK(v.size(0) == B && v.size(1) == N && v.size(2) == H, "v must be [", B, ", ", N, ", ", H, ", Dv], got ",
              chk::shape(v));
  chk::tma_rows(q, "q");
  chk::tma_rows(k, "k");
  chk::tma_rows(v, "v");
  const char* init_names[3] = {"initial_state.zeroth", "initial_state.first", "initial_state.second"};
  const char* final_names[3] = {"final_state.zeroth", "final_state.first", "final_state.second"};
  const tk::based_state initial = state_of(initial_zeroth, initial_first, initial_second, q, B, H, dv + 1, init_names);
  const tk::based_state final_state = state_of(final_zeroth, final_first, final_second, q, B, H, dv + 1, final_names);

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor o = at::empty({B, N, H, dv}, q.options());
  tk::based_problem p{};
  p.type = q.scalar_type() == at::kBFloat16 ? tk::dtype::bf16 : tk::dtype::f16;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  for (int i = 0; i < 3; i++) {
    p.q_strides[i] = q.stride(i);
    p.k_strides[i] = k.stride(i);
    p.v_strides[i] = v.stride(i);
    p.o_strides[i] = o.stride(i);
  }
  p.initial = initial;
  p.final = final_state;
  p.batch = int(B);
  p.seqlen = int(N);
  p.heads = int(H);
  p.head_dim_v = int(dv);
  p.scale = float(scale);
  p.eps = float(eps);
  p.use_norm = use_norm;
  tk::based_prefill(p, chk::sm_count(q.get_device()), c10::cuda::getCurrentCUDAStream());
  return o;
}

at::Tensor based_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& zeroth,
                      at::Tensor& first, at::Tensor& second, double scale, bool use_norm, double eps) {
  chk::cuda(q, "q");
  chk::half_or_bf16(q, "q");
  chk::rank(q, 3, "q");
  chk::rank(k, 3, "k");
  chk::rank(v, 3, "v");
  chk::like(k, q, "k", "q");
  chk::like(v, q, "v", "q");
  head_dims(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape ", chk::shape(q), ", got ", chk::shape(k));
  TORCH_CHECK(v.size(0) == B && v.size(1) == H, "v must be [", B, ", ", H, ", Dv], got ", chk::shape(v));
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k and v must be contiguous in their last dimension");
  const char* names[3] = {"state.zeroth", "state.first", "state.second"};
  const tk::based_state state = state_of(zeroth, first, second, q, B, H, dv + 1, names);

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor o = at::empty({B, H, dv}, q.options());
  tk::based_step_problem p{};
  p.type = q.scalar_type() == at::kBFloat16 ? tk::dtype::bf16 : tk::dtype::f16;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  for (int i = 0; i < 2; i++) {
    p.q_strides[i] = q.stride(i);
    p.k_strides[i] = k.stride(i);
    p.v_strides[i] = v.stride(i);
    p.o_strides[i] = o.stride(i);
  }
  p.state_in = state;
  p.state_out = state;
  p.batch = int(B);
  p.heads = int(H);
  p.head_dim_v = int(dv);
  p.scale = float(scale);
  p.eps = float(eps);
  p.use_norm = use_norm;
  tk::based_step(p, c10::cuda::getCurrentCUDAStream());
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("based_prefill", &based_prefill);
  m.impl("based_step", &based_step);
}
