// TMA (bulk tensor copy engine): global <-> shared tile copies driven by a gl's descriptor.
// Loads complete on a semaphore (expect_bytes first); stores complete in bulk groups.
#pragma once
#include "../tiles/gl.cuh"
#include "../tiles/st.cuh"
#include "semaphore.cuh"

namespace kittens::tma {

namespace detail {
__device__ __forceinline__ uint64_t map_addr(const CUtensorMap* m) { return reinterpret_cast<uint64_t>(m); }
}  // namespace detail

// Bytes one tile copy moves (out-of-bounds elements are zero-filled and still counted).
template <typename Tile> __host__ __device__ constexpr uint32_t bytes() { return Tile::ref_t::bytes; }

// Global -> shared, completing on `sem`. coord is in elements; the tile's chunks are issued in turn.
template <typename Tile, typename GL>
__device__ __forceinline__ void load_async(const Tile& dst, const GL& src, coord c, semaphore& sem) {
  using R = typename Tile::ref_t;
  const R ref = as_ref(dst);
  const uint64_t map = detail::map_addr(src.template tma<R>());
#pragma unroll
  for (int j = 0; j < R::chunks; j++) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(ref.base + j * R::chunk_stride),
        "l"(map), "r"(c.col + j * R::chunk_cols), "r"(c.row), "r"(c.d), "r"(c.b), "r"(sem.addr())
        : "memory");
  }
}

// Shared -> global into the window at c; out-of-bounds rows/cols are clipped by the hardware.
// Writers must have called fence_async_shared() and synchronised before one thread issues this.
template <typename Tile, typename GL>
__device__ __forceinline__ void store_async(const GL& dst, const Tile& src, coord c) {
  using R = typename Tile::ref_t;
  const R ref = as_ref(src);
  const uint64_t map = detail::map_addr(dst.template tma<R>());
#pragma unroll
  for (int j = 0; j < R::chunks; j++) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(map),
                 "r"(ref.base + j * R::chunk_stride), "r"(c.col + j * R::chunk_cols), "r"(c.row), "r"(c.d), "r"(c.b)
                 : "memory");
  }
}

// Warm L2 with a tile that a later load will need.
template <typename Tile, typename GL>
__device__ __forceinline__ void prefetch(const GL& src, coord c) {
  using R = typename Tile::ref_t;
  const uint64_t map = detail::map_addr(src.template tma<R>());
#pragma unroll
  for (int j = 0; j < R::chunks; j++) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(map),
                 "r"(c.col + j * R::chunk_cols), "r"(c.row), "r"(c.d), "r"(c.b)
                 : "memory");
  }
}

// Fetch a descriptor into the descriptor cache ahead of its first use.
template <typename GL, typename Tile> __device__ __forceinline__ void prefetch_descriptor(const GL& g) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(detail::map_addr(g.template tma<typename Tile::ref_t>())) : "memory");
}

// One contiguous run of bytes, global -> shared, completing on `sem` (expect_bytes first). Both addresses 16-byte
// aligned, bytes a multiple of 16: no descriptor, for data laid out as the shared copy wants it.
__device__ __forceinline__ void load_bytes_async(void* dst, const void* src, uint32_t bytes, semaphore& sem) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(bytes), "r"(sem.addr())
               : "memory");
}
// ... and shared -> global, completing in a bulk group (fence_async_shared() and a barrier before, as store_async).
__device__ __forceinline__ void store_bytes_async(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void store_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most N committed store groups still read their shared source.
template <int N = 0> __device__ __forceinline__ void store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Wait until at most N committed store groups are still in flight (writes visible).
template <int N = 0> __device__ __forceinline__ void store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace kittens::tma

namespace kittens {
// Make this thread's ordinary shared-memory writes visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
}  // namespace kittens
