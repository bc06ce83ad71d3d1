// Shared tiles: swizzled, chunked row-major storage that TMA writes and wgmma reads directly.
//
// A tile of R x C elements is stored as column chunks of `swizzle_bytes` per row:
//   chunk j holds columns [j*chunk_cols, (j+1)*chunk_cols) of every row, rows packed at
//   `swizzle_bytes` apart, chunks `chunk_stride` bytes apart.
// Inside a chunk the 16-byte units of each row are XOR-swizzled by the row, exactly as the TMA
// swizzle mode of the same width lays them down and as the wgmma descriptor's swizzle field reads them.
#pragma once
#include "../core/ids.cuh"
#include "../core/types.cuh"

namespace kittens {

// Widest swizzle whose row fits the tile: 128B when a row spans >= 128 bytes, else 64B or 32B.
template <typename T, int C>
inline constexpr bool swizzlable_row = (C * int(sizeof(T))) % 128 == 0 || C * int(sizeof(T)) == 64 ||
                                       C * int(sizeof(T)) == 32;
template <typename T, int C>
consteval int pick_swizzle_bytes() {
  return C * int(sizeof(T)) >= 128 ? 128 : C * int(sizeof(T));
}

// Non-owning view of a swizzled shared tile; ChunkRows is the row count of the storage it lives in
// (a row-block of a taller tile keeps its parent's chunk stride).
template <storage_element T, int R, int C, int ChunkRows = R>
struct st_ref {
  using ref_t = st_ref;
  static_assert(swizzlable_row<T, C>,
                "shared tile rows must span 32, 64 or a multiple of 128 bytes (the TMA/wgmma swizzle widths)");
  static_assert(R % 8 == 0, "shared tile rows must be a multiple of 8 (one swizzle atom)");
  using dtype = T;
  static constexpr int rows = R;
  static constexpr int cols = C;
  static constexpr int swizzle_bytes = pick_swizzle_bytes<T, C>();
  static constexpr int chunk_cols = swizzle_bytes / int(sizeof(T));
  static constexpr int chunks = C / chunk_cols;
  static constexpr int chunk_stride = ChunkRows * swizzle_bytes;
  static constexpr int bytes = R * C * int(sizeof(T));

  uint32_t base;  // shared-window address of element (0, 0)

  // Shared-window address of element (r, c), swizzle applied.
  __device__ __forceinline__ uint32_t addr(int r, int c) const {
    uint32_t a = base + (c / chunk_cols) * chunk_stride + r * swizzle_bytes + (c % chunk_cols) * int(sizeof(T));
    constexpr uint32_t mask = swizzle_bytes / 16 - 1;  // 7, 3, 1
    return a ^ (((a >> 7) & mask) << 4);
  }

  // Rows [i*SR, (i+1)*SR): same columns and chunk stride, offset base.
  template <int SR>
  __device__ __forceinline__ st_ref<T, SR, C, ChunkRows> row_block(int i) const {
    static_assert(R % SR == 0, "row_block: the block height must divide the tile height");
    static_assert(SR % 8 == 0, "row_block: blocks must keep whole swizzle atoms (multiple of 8 rows)");
    return {base + uint32_t(i * SR * swizzle_bytes)};
  }
  // Columns [j*SC, (j+1)*SC): whole chunks only.
  template <int SC>
  __device__ __forceinline__ st_ref<T, R, SC, ChunkRows> col_block(int j) const {
    static_assert(SC % chunk_cols == 0 && C % SC == 0, "col_block: blocks must be whole swizzle chunks");
    return {base + uint32_t(j * (SC / chunk_cols) * chunk_stride)};
  }
};

// Owning shared tile; place it in dynamic shared memory (1024-byte aligned for 128B swizzle atoms).
template <storage_element T, int R, int C>
struct alignas(1024) st {
  static_assert(swizzlable_row<T, C>,
                "shared tile rows must span 32, 64 or a multiple of 128 bytes (the TMA/wgmma swizzle widths)");
  static_assert(R % 8 == 0, "shared tile rows must be a multiple of 8 (one swizzle atom)");
  using ref_t = st_ref<T, R, C, R>;
  using dtype = T;
  static constexpr int rows = R, cols = C, bytes = R * C * int(sizeof(T));
  T data[R * C];
  __device__ __forceinline__ ref_t ref() const {
    return {static_cast<uint32_t>(__cvta_generic_to_shared(data))};
  }
  template <int SR> __device__ __forceinline__ auto row_block(int i) const { return ref().template row_block<SR>(i); }
  template <int SC> __device__ __forceinline__ auto col_block(int j) const { return ref().template col_block<SC>(j); }
};

template <int R, int C> using st_bf = st<bf16, R, C>;
template <int R, int C> using st_hf = st<half, R, C>;
template <int R, int C> using st_fl = st<float, R, C>;

template <typename X> struct is_st_ref : std::false_type {};
template <typename T, int R, int C, int CR> struct is_st_ref<st_ref<T, R, C, CR>> : std::true_type {};
template <typename X> concept shared_tile = is_st_ref<X>::value;

// Anything that can name a shared tile: an st or an st_ref.
template <typename X> __device__ __forceinline__ auto as_ref(const X& x) {
  if constexpr (shared_tile<X>) return x; else return x.ref();
}

}  // namespace kittens
