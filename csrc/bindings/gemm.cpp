// torch.library CUDA implementations of tk::gemm and tk::gemm_out (schemas are defined in Python).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include "../kernels/gemm.h"
#include "checks.h"

namespace {

void gemm_out(const at::Tensor& a, const at::Tensor& b, bool trans_b, at::Tensor& out) {
  namespace chk = tk::checks;
  chk::cuda(a, "a");
  chk::half_or_bf16(a, "a");
  chk::rank(a, 2, "a");
  chk::rank(b, 2, "b");
  chk::rank(out, 2, "out");
  chk::like(b, a, "b", "a");
  chk::like(out, a, "out", "a");
  const int64_t m = a.size(0), k = a.size(1), n = trans_b ? b.size(0) : b.size(1);
  TORCH_CHECK((trans_b ? b.size(1) : b.size(0)) == k, "b's reduction dimension must equal a.shape[1] = ", k,
              ", got b of shape ", chk::shape(b), (trans_b ? " with trans_b=True" : ""));
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "out must have shape [", m, ", ", n, "], got ", chk::shape(out));
  TORCH_CHECK(m >= 1 && n >= 1 && k >= 1, "gemm needs M, N, K >= 1, got ", m, ", ", n, ", ", k);
  TORCH_CHECK(m < (1L << 31) && n < (1L << 31) && k < (1L << 31), "gemm dimensions must be below 2^31");
  chk::tma_rows(a, "a");
  chk::tma_rows(b, "b");
  chk::tma_rows(out, "out");

  const c10::cuda::CUDAGuard guard(a.device());
  const tk::gemm_problem p{
      .a = a.data_ptr(), .b = b.data_ptr(), .c = out.data_ptr(), .m = m, .n = n, .k = k,
      .lda = a.stride(0), .ldb = b.stride(0), .ldc = out.stride(0), .b_is_nk = trans_b,
      .type = a.scalar_type() == at::kBFloat16 ? tk::dtype::bf16 : tk::dtype::f16,
  };
  tk::gemm(p, tk::checks::sm_count(a.get_device()), c10::cuda::getCurrentCUDAStream());
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, bool trans_b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "a and b must have 2 dimensions, got ", a.dim(), " and ", b.dim());
  at::Tensor out = at::empty({a.size(0), trans_b ? b.size(0) : b.size(1)}, a.options());
  gemm_out(a, b, trans_b, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("gemm_out", &gemm_out);
}
