// Thread-block clusters: rank, cluster-wide barrier, remote semaphore arrival, and TMA multicast (one
// load lands in the same shared offset of every CTA named in a mask, completing on each one's semaphore).
#pragma once
#include "../tiles/gl.cuh"
#include "../tiles/st.cuh"
#include "semaphore.cuh"

namespace kittens {

__device__ __forceinline__ int cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return int(r);
}
__device__ __forceinline__ int cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return int(r);
}
__device__ __forceinline__ int cluster_count_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return int(r);
}
// Every thread of every CTA in the cluster; also orders shared-memory writes (semaphore init) before.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// Arrive on the semaphore at the same shared offset in CTA `cta` of this cluster.
__device__ __forceinline__ void arrive_remote(semaphore& s, int cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(s.addr()), "r"(cta));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

namespace tma {
// Global -> the shared tile `dst` of every CTA in `cta_mask`, completing on each CTA's `sem`.
template <typename Tile, typename GL>
__device__ __forceinline__ void load_async_multicast(const Tile& dst, const GL& src, coord c, semaphore& sem,
                                                     uint16_t cta_mask) {
  using R = typename Tile::ref_t;
  const R ref = as_ref(dst);
  const uint64_t map = reinterpret_cast<uint64_t>(src.template tma<R>());
#pragma unroll
  for (int j = 0; j < R::chunks; j++) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(ref.base + j * R::chunk_stride),
        "l"(map), "r"(c.col + j * R::chunk_cols), "r"(c.row), "r"(c.d), "r"(c.b), "r"(sem.addr()), "h"(cta_mask)
        : "memory");
  }
}
}  // namespace tma

}  // namespace kittens
