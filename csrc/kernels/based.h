// Based linear attention launch interfaces (host): chunked prefill and the recurrent decode step.
#pragma once
#include <cuda_runtime.h>
#include "gemm.h"  // tk::dtype

namespace tk {

// The recurrent state of one (batch, head), float32, Dv + 1 columns (the values, then the normaliser):
//   zeroth [W], first [16, W], second [16 * 16, W] with W = Dv + 1, each contiguous per (batch, head)
//   at (b * heads + h) * its size. Null pointers: no initial state (zeros) / no final state wanted.
struct based_state {
  float* zeroth;
  float* first;
  float* second;
};

// q, k [B, N, H, 16] and v, o [B, N, H, Dv] with any strides but a unit last one (in elements).
struct based_problem {
  dtype type;
  const void* q;
  const void* k;
  const void* v;
  void* o;
  long q_strides[3], k_strides[3], v_strides[3], o_strides[3];  // batch, token, head
  based_state initial, final;
  int batch, seqlen, heads, head_dim_v;
  float scale, eps;
  bool use_norm;
};

void based_prefill(const based_problem& p, int num_sms, cudaStream_t stream);

// One token: q, k [B, H, 16], v, o [B, H, Dv] (strides batch, head); state_in -> state_out (may alias).
struct based_step_problem {
  dtype type;
  const void* q;
  const void* k;
  const void* v;
  void* o;
  long q_strides[2], k_strides[2], v_strides[2], o_strides[2];
  based_state state_in, state_out;
  int batch, heads, head_dim_v;
  float scale, eps;
  bool use_norm;
};

void based_step(const based_step_problem& p, cudaStream_t stream);

}  // namespace tk
