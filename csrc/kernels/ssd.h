// Mamba-2 SSD launch interfaces (host): the chunked scan (prefill) and the one-token state update (decode).
#pragma once
#include <cuda_runtime.h>
#include "gemm.h"  // tk::dtype

namespace tk {

// Strides are in elements; every innermost dimension (head dim, state dim) is contiguous.
// Dense: x [batch, seqlen, heads, headdim], every batch row one sequence. Varlen: batch 1, sequence s is
// tokens [cu_seqlens[s], cu_seqlens[s + 1]). States are float32 [num_seqs, heads, headdim, dstate].
struct ssd_scan_problem {
  dtype type;  // of x, B, C, z and out
  int batch, heads, headdim, groups, dstate, num_seqs;
  long seqlen;
  const void* x;
  long x_strides[3];  // batch, token, head
  const float* dt;    // [batch, seqlen, heads], raw (before bias / softplus / clamp)
  long dt_strides[3];
  const float* A;        // [heads]
  const float* dt_bias;  // [heads] or null
  const float* D;        // [heads, headdim] with strides D_strides (p stride 0 for a per-head D), or null
  long D_strides[2];
  const void* B;
  long B_strides[3];  // batch, token, group
  const void* C;
  long C_strides[3];
  const void* z;  // like x, or null
  long z_strides[3];
  void* out;  // like x
  long out_strides[3];
  const int* cu_seqlens;         // [num_seqs + 1] or null (dense)
  const float* initial_states;   // or null (zeros)
  long init_strides[3];          // seq, head, p
  float* final_states;           // or null (not wanted)
  long final_strides[3];
  bool dt_softplus;
  float dt_min, dt_max;
  int* workspace;  // int32 [ssd_scan_workspace(...)], device: the task counter, then the sequence order
};

// A ragged batch (varlen, more than one sequence): its tasks differ in length and are claimed dynamically,
// which takes a workspace; a fixed batch needs none.
inline bool ssd_scan_ragged(bool varlen, long num_seqs) { return varlen && num_seqs > 1; }
inline long ssd_scan_workspace(bool varlen, long num_seqs) { return ssd_scan_ragged(varlen, num_seqs) ? 1 + num_seqs : 0; }

void ssd_scan(const ssd_scan_problem& p, int num_sms, cudaStream_t stream);

// selective_state_update: state [num_states, heads, headdim, dstate] (float32 or x's type), x / z / out
// [batch, heads, headdim], dt [batch, heads, headdim] float32, A [heads, headdim, dstate] float32,
// B / C [batch, groups, dstate], D / dt_bias [heads, headdim] float32; any strides (0 broadcasts) except a
// contiguous dstate in state, B and C. Batch row b updates state row state_indices[b] (b if null); a row
// whose index equals pad_slot_id is skipped (state and out untouched), as is one outside [0, num_states).
struct ssd_update_problem {
  dtype type;         // of x, B, C, z, out
  bool state_fp32;    // else the state has x's type
  int batch, heads, headdim, groups, dstate;
  long num_states;
  void* state;
  long state_strides[3];  // slot, head, p
  const void* x;
  long x_strides[2];  // batch, head (p contiguous)
  const float* dt;
  long dt_strides[3];  // batch, head, p
  const float* A;
  long A_strides[3];  // head, p, n
  const void* B;
  long B_strides[2];  // batch, group
  const void* C;
  long C_strides[2];
  const float* D;  // or null
  long D_strides[2];
  const void* z;  // or null
  long z_strides[2];
  const float* dt_bias;  // or null
  long dt_bias_strides[2];
  const int* state_indices;  // [batch] or null
  int pad_slot_id;
  bool dt_softplus;
  void* out;
  long out_strides[2];
};

void ssd_update(const ssd_update_problem& p, cudaStream_t stream);

}  // namespace tk
