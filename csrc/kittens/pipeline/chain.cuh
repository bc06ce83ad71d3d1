// Chained kernels (programmatic dependent launch). A kernel launched with `chain::launch` (or an lcsf policy
// with `static constexpr bool chained = true`) may be scheduled while the kernel before it on the stream still
// runs: as soon as every CTA of that kernel has called `chain::allow_next()` or exited. Its CTAs then do their
// prologue (shared memory, semaphores, the launch itself) in the earlier kernel's shadow, and must call
// `chain::wait()` before they touch global memory: it returns once the earlier kernel has completed and its
// writes are visible, so the stream's order holds from there on. Both calls are no-ops in a kernel launched
// without the attribute; stream capture records the attribute as a programmatic edge of the CUDA graph.
#pragma once
#include <cuda_runtime.h>
#include <utility>
#include "../core/errors.cuh"

namespace kittens::chain {

// Everything after this sees the previous kernel on the stream complete, its writes included.
__device__ __forceinline__ void wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// The next kernel on the stream, if chained, may be scheduled once every CTA of this one has said so (or exited).
__device__ __forceinline__ void allow_next() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

inline cudaLaunchAttribute attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// kernel<<<grid, block, smem, stream>>>(args...), chained to the stream's previous kernel.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr = attribute();
  config.attrs = &attr;
  config.numAttrs = 1;
  TK_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace kittens::chain
