// GEMM launch interface (host): C[M, N] = A[M, K] @ B, B given as K x N or N x K (row-major views).
#pragma once
#include <cuda_runtime.h>

namespace tk {

enum class dtype { bf16, f16 };

struct gemm_problem {
  const void* a;
  const void* b;
  void* c;
  long m, n, k;
  long lda, ldb, ldc;  // row strides in elements; rows are contiguous
  bool b_is_nk;        // B stored as N x K (C = A @ B^T), else K x N
  dtype type;
};

// Launches the persistent kernel on `stream` over at most `num_sms` CTAs. No host sync, no allocation.
void gemm(const gemm_problem& p, int num_sms, cudaStream_t stream);

}  // namespace tk
