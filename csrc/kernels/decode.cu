// Split-KV paged decode on kittens. A work item is (sequence, kv head, key range); the query rows of one KV
// head (q_len new tokens x the heads of its group, at most 64) are packed into one 64-row tile, so every
// query head of the group shares each K/V load and one wgmma. CTA c runs the items the plan gave it, in
// order, while its producer streams the item's keys page piece by page piece (16 rows, any block size).
// Each item leaves a normalised partial output and its LSE; a small kernel then merges a segment's items.
#include "../kittens/kittens.cuh"
#include "attention.h"
#include "attention_common.cuh"

using namespace kittens;

namespace {

template <typename T, int D>
struct attn_decode_split {
  static constexpr int consumers = 1, ROWS = 64, PIECE = 16;
  static constexpr int KV = D == 256 ? 48 : 128;
  static constexpr int stages = D == 64 ? 6 : D == 128 ? 3 : 3;
  using q_tile = st<T, ROWS, D>;
  using kv_tile = st<T, KV, D>;
  using piece = st<T, PIECE, D>;
  using pages_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, D, piece>;  // (blocks, heads, block_size, D)

  struct globals {
    pages_gl k, v;
    const T* q;
    long q_strides[3];
    const int *cache_seqlens, *block_table, *work_items, *cta_start;
    long bt_stride;
    gl<float, 1, RUNTIME, RUNTIME, D> partial_out;  // (1, items, rows, D)
    float* partial_lse;
    int q_len, group, block_size, causal, window_left, window_right;
    float scale_log2, softcap;
  };
  struct input_block { kv_tile k, v; };
  struct scratch_block { q_tile q; };
  using s_tile = rt_fl<16, KV>;
  using row_vec = typename s_tile::per_row;
  struct consumer_state {
    rt_fl<16, D> o;
    rt<T, 16, KV> p;
    row_vec m, l, rescale;
    const kv_tile* v_prev;
  };
  struct task_t { int item, b, h, start, end, base, len, iters; };

  __device__ static int2 task_range(const globals& g, int cta, int) {
    return {g.cta_start[cta], g.cta_start[cta + 1]};
  }
  __device__ static int task_count(const globals&) { return 0; }  // unused: task_range decides
  __device__ static task_t task(const globals& g, int id, int) {
    const int4 w = reinterpret_cast<const int4*>(g.work_items)[id];
    task_t t{id, w.x, w.y, w.z, w.w, w.z & ~(PIECE - 1), g.cache_seqlens[w.x], 0};
    t.iters = w.w > w.z ? ceil_div(w.w - t.base, KV) : 0;  // empty slots carry no work
    return t;
  }

  __device__ static void load(input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    expect_bytes(full, 2 * tma::bytes<kv_tile>());
    const int row = t.base + it * KV, last = (t.end - 1) & ~(PIECE - 1);  // pieces past the end re-read the last
#pragma unroll
    for (int s = 0; s < KV / PIECE; s++) {
      const int token = min(row + s * PIECE, last);
      const int page = g.block_table[t.b * g.bt_stride + token / g.block_size];
      const coord at{.b = page, .d = t.h, .row = token % g.block_size};
      tma::load_async(in.k.template row_block<PIECE>(s), g.k, at, full);
      tma::load_async(in.v.template row_block<PIECE>(s), g.v, at, full);
    }
  }

  __device__ static void init_state(consumer_state& s, int) { reset(s); }
  __device__ static void reset(consumer_state& s) {
    zero(s.o);
    fill(s.m, -INFINITY);
    zero(s.l);
  }
  __device__ static tk::attn::scoring scoring(const globals& g) { return {g.scale_log2, g.softcap}; }
  // Keys of other items (past `end`) are hidden like keys past the sequence; the query of row r is r / group.
  __device__ static tk::attn::visibility<true> visibility(const globals& g, const task_t& t) {
    return {t.end, t.len - g.q_len, g.window_left, g.window_right, g.group, bool(g.causal)};
  }

  // The packed query tile: row r = t * group + g holds q[b, t, h * group + g]; rows past q_len * group are 0.
  __device__ static void load_queries(scratch_block& scratch, const globals& g, const task_t& t) {
    constexpr int vecs_per_row = D * int(sizeof(T)) / 16;
    const int rows = g.q_len * g.group;
    for (int v = warpgroup::thread(); v < ROWS * vecs_per_row; v += WARPGROUP_THREADS) {
      const int r = v / vecs_per_row, col = (v % vecs_per_row) * (16 / int(sizeof(T)));
      uint4 x{0, 0, 0, 0};
      if (r < rows) {
        const int tok = r / g.group, head = t.h * g.group + r % g.group;
        x = *reinterpret_cast<const uint4*>(g.q + t.b * g.q_strides[0] + tok * g.q_strides[1] +
                                            head * g.q_strides[2] + col);
      }
      detail::st_shared_16B(scratch.q.ref().addr(r, col), x);
    }
    fence_async_shared();  // the tile is read by wgmma next
    warpgroup::sync(1);
  }

  __device__ static void softmax(consumer_state& s, s_tile& att, const globals& g, const task_t& t, int it) {
    tk::attn::online_softmax(att, s.m, s.l, s.rescale, scoring(g), visibility(g, t), warpgroup::warp() * 16,
                             t.base + it * KV);
  }

  __device__ static void compute_first(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                       const task_t& t, int) {
    load_queries(scratch, g, t);
    s_tile att;
    warpgroup::mm_ABt(att, scratch.q, in.k);
    warpgroup::mma_async_wait<0>();
    softmax(s, att, g, t, 0);
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = &in.v;
  }

  // Tile j: S_j and the previous tile's P V go out together; the softmax of S_j overlaps that P V.
  __device__ static void compute(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                 const task_t& t, int it, int) {
    s_tile att;
    warpgroup::mm_ABt(att, scratch.q, in.k);
    mul_row(s.o, s.o, s.rescale);
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    warpgroup::mma_async_wait<1>();
    softmax(s, att, g, t, it);
    warpgroup::mma_async_wait<0>();
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = &in.v;
  }

  __device__ static void drain(consumer_state& s, scratch_block&, const globals&, const task_t&, int) {
    mul_row(s.o, s.o, s.rescale);
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    wgmma::fence_operand(s.p);
  }

  __device__ static void finish(consumer_state& s, scratch_block&, const globals& g, const task_t& t, int) {
    wgmma::fence_operand(s.p);
    if (t.iters > 0) {
      const int rows = g.q_len * g.group;
      row_vec lse;
      tk::attn::finalize(s.o, lse, s.m, s.l, scoring(g));
      warpgroup::store(g.partial_out, s.o, {.d = t.item}, rows);
      if (laneid() % 4 == 0) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
          const int r = warpgroup::warp() * 16 + laneid() / 4 + 8 * half;
          if (r < rows) g.partial_lse[long(t.item) * rows + r] = lse.data[0][half];
        }
      }
    }
    reset(s);
  }
};

// The LSE merge of a segment's items: one block per (sequence, kv head), a thread per (row, column).
template <typename T>
__global__ void merge_partials(const int* __restrict__ work_items, const float* __restrict__ partial_out,
                               const float* __restrict__ partial_lse, T* __restrict__ out, long os0, long os1,
                               long os2, float* __restrict__ lse, int q_len, int group, int hq, int hkv, int max_splits,
                               int d) {
  const int seg = blockIdx.x, b = seg / hkv, h = seg % hkv, rows = q_len * group;
  const int first = seg * max_splits;
  for (int idx = threadIdx.x; idx < rows * d; idx += blockDim.x) {
    const int r = idx / d, col = idx % d;
    float m = -INFINITY;
    for (int s = 0; s < max_splits; s++) {
      const int4 w = reinterpret_cast<const int4*>(work_items)[first + s];
      if (w.w > w.z) m = fmaxf(m, partial_lse[long(first + s) * rows + r]);
    }
    float acc = 0.f, weight = 0.f;
    if (m != -INFINITY) {
      for (int s = 0; s < max_splits; s++) {
        const int4 w = reinterpret_cast<const int4*>(work_items)[first + s];
        if (w.w <= w.z) continue;
        const float x = partial_lse[long(first + s) * rows + r];
        const float wgt = x == -INFINITY ? 0.f : __expf(x - m);
        weight += wgt;
        acc += wgt * partial_out[(long(first + s) * rows + r) * d + col];
      }
    }
    const int tok = r / group, head = h * group + r % group;
    out[b * os0 + tok * os1 + head * os2 + col] = kittens::convert<T>(weight > 0.f ? acc / weight : 0.f);
    if (col == 0) lse[(long(b) * hq + head) * q_len + tok] = weight > 0.f ? m + __logf(weight) : -INFINITY;
  }
}

template <typename T, int D>
void run(const tk::attn_decode_problem& p, cudaStream_t stream) {
  using K = attn_decode_split<T, D>;
  auto ptr = [](const void* x) { return static_cast<T*>(const_cast<void*>(x)); };
  const int group = p.hq / p.hkv, rows = p.q_len * group;
  typename K::globals g{};
  g.k = {ptr(p.k), {p.num_blocks, p.hkv, p.block_size, D}, {p.k_strides[0], p.k_strides[2], p.k_strides[1], 1}};
  g.v = {ptr(p.v), {p.num_blocks, p.hkv, p.block_size, D}, {p.v_strides[0], p.v_strides[2], p.v_strides[1], 1}};
  g.q = ptr(p.q);
  for (int i = 0; i < 3; i++) g.q_strides[i] = p.q_strides[i];
  g.cache_seqlens = p.cache_seqlens;
  g.block_table = p.block_table;
  g.bt_stride = p.bt_stride;
  g.work_items = p.work_items;
  g.cta_start = p.cta_start;
  g.partial_out = {p.partial_out, {1, p.max_items, rows, D}};
  g.partial_lse = p.partial_lse;
  g.q_len = p.q_len;
  g.group = group;
  g.block_size = p.block_size;
  g.causal = p.causal;
  g.window_left = p.window_left;
  g.window_right = p.window_right;
  g.scale_log2 = p.softmax_scale * tk::attn::LOG2E;
  g.softcap = p.softcap;
  lcsf::launch<K>(g, p.num_ctas, stream);
  merge_partials<T><<<p.batch * p.hkv, 256, 0, stream>>>(
      p.work_items, p.partial_out, p.partial_lse, static_cast<T*>(p.out), p.out_strides[0], p.out_strides[1],
      p.out_strides[2], p.lse, p.q_len, group, p.hq, p.hkv, p.max_splits, D);
  TK_LAUNCH_CHECK();
}

template <typename T>
void run_dtype(const tk::attn_decode_problem& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return run<T, 64>(p, stream);
    case 128: return run<T, 128>(p, stream);
    case 256: return run<T, 256>(p, stream);
  }
}

}  // namespace

namespace tk {

void attn_decode(const attn_decode_problem& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  if (p.type == dtype::bf16) run_dtype<bf16>(p, stream);
  else run_dtype<half>(p, stream);
}

}  // namespace tk
