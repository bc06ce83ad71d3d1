// mbarrier semaphores: the completion signal of TMA copies and the stage hand-off of pipelines.
#pragma once
#include <cstdint>

namespace kittens {

struct semaphore {
  uint64_t word;
  __device__ __forceinline__ uint32_t addr() const { return static_cast<uint32_t>(__cvta_generic_to_shared(&word)); }
};

// Arrivals expected per phase; call from one thread, then fence + block barrier before first use.
__device__ __forceinline__ void init_semaphore(semaphore& s, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(s.addr()), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void fence_semaphore_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` of asynchronous (TMA) traffic this phase must wait for.
__device__ __forceinline__ void expect_bytes(semaphore& s, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(s.addr()), "r"(bytes) : "memory");
}
__device__ __forceinline__ void arrive(semaphore& s) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(s.addr()) : "memory");
}
// Block until the phase with parity `phase` has completed.
__device__ __forceinline__ void wait(semaphore& s, int phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(s.addr()),
      "r"(phase)
      : "memory");
}
// Non-blocking probe: has the phase with parity `phase` completed?
__device__ __forceinline__ bool test(semaphore& s, int phase) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(s.addr()), "r"(phase)
      : "memory");
  return done != 0;
}

}  // namespace kittens
