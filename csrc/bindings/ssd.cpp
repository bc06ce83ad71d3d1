// torch.library CUDA implementations of tk::ssd_scan and tk::ssd_update (schemas in tk_backend/mamba.py,
// which validates first; these checks are the last line before a launch).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include "../kernels/ssd.h"
#include "checks.h"

namespace {

namespace chk = tk::checks;

const float* f32_ptr(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
  chk::same_device(*t, x, name, "x");
  return t->data_ptr<float>();
}

void ssd_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
              const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
              const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& initial_states,
              const std::optional<at::Tensor>& cu_seqlens, bool dt_softplus, double dt_min, double dt_max,
              at::Tensor& out, const std::optional<at::Tensor>& final_states) {
  chk::cuda(x, "x");
  chk::half_or_bf16(x, "x");
  chk::rank(x, 4, "x");
  chk::rank(B, 4, "B");
  chk::like(B, x, "B", "x");
  chk::like(C, x, "C", "x");
  chk::like(out, x, "out", "x");
  const int64_t batch = x.size(0), seqlen = x.size(1), heads = x.size(2), headdim = x.size(3);
  const int64_t groups = B.size(2), dstate = B.size(3);
  TORCH_CHECK(headdim == 64 || headdim == 128, "headdim must be 64 or 128, got ", headdim);
  TORCH_CHECK(dstate == 64 || dstate == 128 || dstate == 256, "dstate must be 64, 128 or 256, got ", dstate);
  TORCH_CHECK(groups >= 1 && heads % groups == 0, "nheads (", heads, ") must be a multiple of ngroups (", groups, ")");
  TORCH_CHECK(B.sizes() == C.sizes(), "C must have B's shape");
  TORCH_CHECK(B.size(0) == batch && B.size(1) == seqlen, "B must be [batch, seqlen, ngroups, dstate]");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  TORCH_CHECK(dt.dim() == 3 && dt.size(0) == batch && dt.size(1) == seqlen && dt.size(2) == heads,
              "dt must be float32 [batch, seqlen, nheads]");
  TORCH_CHECK(A.dim() == 1 && A.size(0) == heads && A.is_contiguous(), "A must be contiguous [nheads]");
  chk::tma_rows(x, "x");
  chk::tma_rows(B, "B");
  chk::tma_rows(C, "C");
  chk::tma_rows(out, "out");

  const c10::cuda::CUDAGuard guard(x.device());
  tk::ssd_scan_problem p{};
  p.type = x.scalar_type() == at::kBFloat16 ? tk::dtype::bf16 : tk::dtype::f16;
  p.batch = int(batch);
  p.heads = int(heads);
  p.headdim = int(headdim);
  p.groups = int(groups);
  p.dstate = int(dstate);
  p.seqlen = seqlen;
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.B = B.data_ptr();
  p.C = C.data_ptr();
  for (int i = 0; i < 3; i++) {
    p.x_strides[i] = x.stride(i);
    p.out_strides[i] = out.stride(i);
    p.B_strides[i] = B.stride(i);
    p.C_strides[i] = C.stride(i);
  }
  p.dt = f32_ptr(dt, x, "dt");
  for (int i = 0; i < 3; i++) p.dt_strides[i] = dt.stride(i);
  p.A = f32_ptr(A, x, "A");
  p.dt_bias = f32_ptr(dt_bias, x, "dt_bias");
  if (dt_bias) TORCH_CHECK(dt_bias->dim() == 1 && dt_bias->size(0) == heads && dt_bias->is_contiguous(),
                           "dt_bias must be contiguous [nheads]");
  p.D = f32_ptr(D, x, "D");
  if (D) {
    TORCH_CHECK(D->dim() == 2 && D->size(0) == heads && D->size(1) == headdim, "D must be [nheads, headdim]");
    p.D_strides[0] = D->stride(0);
    p.D_strides[1] = D->stride(1);
  }
  if (z) {
    chk::like(*z, x, "z", "x");
    TORCH_CHECK(z->sizes() == x.sizes() && z->stride(3) == 1, "z must have x's shape and a contiguous last dim");
    p.z = z->data_ptr();
    for (int i = 0; i < 3; i++) p.z_strides[i] = z->stride(i);
  }
  int64_t num_seqs = batch;
  if (cu_seqlens) {
    TORCH_CHECK(cu_seqlens->scalar_type() == at::kInt && cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 1 &&
                    cu_seqlens->is_contiguous(), "cu_seqlens must be contiguous int32 [num_seqs + 1]");
    chk::same_device(*cu_seqlens, x, "cu_seqlens", "x");
    TORCH_CHECK(batch == 1, "x must have batch 1 with cu_seqlens, got ", batch);
    num_seqs = cu_seqlens->size(0) - 1;
    p.cu_seqlens = cu_seqlens->data_ptr<int>();
  }
  p.num_seqs = int(num_seqs);
  auto states = [&](const at::Tensor& s, const char* name, long* strides) {
    TORCH_CHECK(s.dim() == 4 && s.size(0) == num_seqs && s.size(1) == heads && s.size(2) == headdim &&
                    s.size(3) == dstate && s.stride(3) == 1,
                name, " must be float32 [", num_seqs, ", ", heads, ", ", headdim, ", ", dstate,
                "] with a contiguous last dim");
    for (int i = 0; i < 3; i++) strides[i] = s.stride(i);
  };
  p.initial_states = f32_ptr(initial_states, x, "initial_states");
  if (initial_states) states(*initial_states, "initial_states", p.init_strides);
  p.final_states = const_cast<float*>(f32_ptr(final_states, x, "final_states"));
  if (final_states) states(*final_states, "final_states", p.final_strides);
  p.dt_softplus = dt_softplus;
  p.dt_min = float(dt_min);
  p.dt_max = float(dt_max);
  // Sized by the shapes only (graph-safe); the caching allocator serves it from the current stream's pool.
  const long workspace_ints = tk::ssd_scan_workspace(p.cu_seqlens != nullptr, num_seqs);
  at::Tensor workspace;
  if (workspace_ints > 0) workspace = at::empty({workspace_ints}, x.options().dtype(at::kInt));
  p.workspace = workspace_ints > 0 ? workspace.data_ptr<int>() : nullptr;
  tk::ssd_scan(p, chk::sm_count(x.get_device()), c10::cuda::getCurrentCUDAStream());
}

void ssd_update(at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                const std::optional<at::Tensor>& dt_bias, bool dt_softplus,
                const std::optional<at::Tensor>& state_batch_indices, int64_t pad_slot_id, at::Tensor& out) {
  chk::cuda(x, "x");
  chk::half_or_bf16(x, "x");
  chk::rank(x, 3, "x");
  chk::rank(state, 4, "state");
  chk::like(B, x, "B", "x");
  chk::like(C, x, "C", "x");
  chk::like(out, x, "out", "x");
  chk::same_device(state, x, "state", "x");
  TORCH_CHECK(state.scalar_type() == at::kFloat || state.scalar_type() == x.scalar_type(),
              "state must be float32 or x's dtype, got ", state.scalar_type());
  const int64_t batch = x.size(0), heads = x.size(1), headdim = x.size(2), groups = B.size(1), dstate = B.size(2);
  TORCH_CHECK(state.size(1) == heads && state.size(2) == headdim && state.size(3) == dstate && state.stride(3) == 1,
              "state must be [num_states, nheads, headdim, dstate] with a contiguous last dim");
  TORCH_CHECK(B.dim() == 3 && B.size(0) == batch && B.stride(2) == 1 && B.sizes() == C.sizes() && C.stride(2) == 1,
              "B and C must be [batch, ngroups, dstate] with a contiguous last dim");
  TORCH_CHECK(groups >= 1 && heads % groups == 0, "nheads must be a multiple of ngroups");
  TORCH_CHECK(x.stride(2) == 1 && out.stride(2) == 1 && out.sizes() == x.sizes(), "x and out need a contiguous last dim");
  TORCH_CHECK(dt.dim() == 3 && dt.size(0) == batch && dt.size(1) == heads && dt.size(2) == headdim,
              "dt must be float32 [batch, nheads, headdim]");
  TORCH_CHECK(A.dim() == 3 && A.size(0) == heads && A.size(1) == headdim && A.size(2) == dstate,
              "A must be float32 [nheads, headdim, dstate]");

  const c10::cuda::CUDAGuard guard(x.device());
  tk::ssd_update_problem p{};
  p.type = x.scalar_type() == at::kBFloat16 ? tk::dtype::bf16 : tk::dtype::f16;
  p.state_fp32 = state.scalar_type() == at::kFloat;
  p.batch = int(batch);
  p.heads = int(heads);
  p.headdim = int(headdim);
  p.groups = int(groups);
  p.dstate = int(dstate);
  p.num_states = state.size(0);
  p.state = state.data_ptr();
  for (int i = 0; i < 3; i++) p.state_strides[i] = state.stride(i);
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.B = B.data_ptr();
  p.C = C.data_ptr();
  for (int i = 0; i < 2; i++) {
    p.x_strides[i] = x.stride(i);
    p.out_strides[i] = out.stride(i);
    p.B_strides[i] = B.stride(i);
    p.C_strides[i] = C.stride(i);
  }
  p.dt = f32_ptr(dt, x, "dt");
  p.A = f32_ptr(A, x, "A");
  for (int i = 0; i < 3; i++) p.dt_strides[i] = dt.stride(i), p.A_strides[i] = A.stride(i);
  p.D = f32_ptr(D, x, "D");
  if (D) {
    TORCH_CHECK(D->dim() == 2 && D->size(0) == heads && D->size(1) == headdim, "D must be [nheads, headdim]");
    p.D_strides[0] = D->stride(0), p.D_strides[1] = D->stride(1);
  }
  p.dt_bias = f32_ptr(dt_bias, x, "dt_bias");
  if (dt_bias) {
    TORCH_CHECK(dt_bias->dim() == 2 && dt_bias->size(0) == heads && dt_bias->size(1) == headdim,
                "dt_bias must be [nheads, headdim]");
    p.dt_bias_strides[0] = dt_bias->stride(0), p.dt_bias_strides[1] = dt_bias->stride(1);
  }
  if (z) {
    chk::like(*z, x, "z", "x");
    TORCH_CHECK(z->sizes() == x.sizes() && z->stride(2) == 1, "z must have x's shape and a contiguous last dim");
    p.z = z->data_ptr();
    p.z_strides[0] = z->stride(0), p.z_strides[1] = z->stride(1);
  }
  if (state_batch_indices) {
    TORCH_CHECK(state_batch_indices->scalar_type() == at::kInt && state_batch_indices->dim() == 1 &&
                    state_batch_indices->size(0) == batch && state_batch_indices->is_contiguous(),
                "state_batch_indices must be contiguous int32 [batch]");
    chk::same_device(*state_batch_indices, x, "state_batch_indices", "x");
    p.state_indices = state_batch_indices->data_ptr<int>();
  } else {
    TORCH_CHECK(state.size(0) == batch, "state must have batch rows without state_batch_indices");
  }
  p.pad_slot_id = int(pad_slot_id);
  p.dt_softplus = dt_softplus;
  tk::ssd_update(p, c10::cuda::getCurrentCUDAStream());
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("ssd_scan", &ssd_scan);
  m.impl("ssd_update", &ssd_update);
}
