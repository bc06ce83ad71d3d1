// Split-KV paged decode as an lcsf kernel. A work item is (sequence, kv head, key range); the query rows of one KV
// head (q_len new tokens x the heads of its group, at most 64) are packed into one 64-row tile, so every query head
// of the group shares each K/V load and one wgmma. CTA c runs the items its schedule gives it, in order, while its
// producer streams the item's keys page piece by page piece (16 rows, any block size). Each item leaves a
// normalised partial output and its LSE for the merge (merge.cuh); an item that covers its sequence's whole visible
// range writes out and lse itself, and the merge passes its segment by.
// Over FP8 caches (P.fp8_kv) the ring holds e4m3 tiles, which the producer warpgroup's idle warps convert into a
// second ring of fp16 tiles (lcsf's converted ring, dequant.cuh) while the consumer computes on the previous ones:
// the consumer's work is the 16-bit kernel's, on fp16 queries and tiles; k_descale (and q_descale) fold into the
// task's score scale and v_descale scales its output rows. With an e4m3 query (P.fp8_q: vLLM's, quantized per
// tensor) S = Q K^T is an e4m3 product on the raw ring's K tiles (lcsf's reads_raw_stage) and only V converts, which
// halves the conversion and the shared-memory bytes of S.
#pragma once
#include "../attention/masks.cuh"
#include "../attention/paging.cuh"
#include "../attention/softmax.cuh"
#include "dequant.cuh"
#include "policy.cuh"
#include "schedule.cuh"

namespace tk::decode {

template <typename T, policy P, schedule_source Source>
struct attn_decode_split {
  static constexpr int D = P.head_dim, consumers = 1, ROWS = 64, PIECE = 16, KV = P.kv_rows, stages = P.stages;
  // Chained to whatever came before (balanced mode: its schedule kernel), and the merge to this one: each
  // launch overlaps the previous kernel's tail (the b1 cases are a few microseconds a kernel).
  static constexpr lcsf::options pipeline{.chain = lcsf::launch_chain::chained};
  // More page lookups in flight (policy::page_lookups) hold a register pair each in the producer: 40 spilled them.
  static constexpr int min_producer_registers = P.page_lookups > 2 ? 64 : 0;
  static_assert(!P.fp8_q || (P.fp8_kv && !P.ragged_head_dim), "an e4m3 query: over fp8 caches, at tile head dims");
  using mma_t = std::conditional_t<P.fp8_kv, half, T>;      // the products' inputs (P V's; and Q K^T's but fp8_q)
  using cache_t = std::conditional_t<P.fp8_kv, fp8e4m3, T>;  // the caches' elements
  using q_elem_t = std::conditional_t<P.fp8_q, fp8e4m3, T>;  // q's elements (T: out's)
  using q_tile = st<std::conditional_t<P.fp8_q, fp8e4m3, mma_t>, ROWS, D>;
  using kv_tile = st<cache_t, KV, D>;
  using mma_kv_tile = st<mma_t, KV, D>;  // the tiles the products read: the ring's, or (fp8) the converted ring's
  using piece = st<cache_t, PIECE, D>;
  static constexpr int COLS = P.ragged_head_dim ? RUNTIME : D;         // the caches' head dim
  using pages_gl = gl<cache_t, RUNTIME, RUNTIME, RUNTIME, COLS, piece>;  // (blocks, heads, block_size, head dim)

  struct globals {
    pages_gl k, v;
    const q_elem_t* q;
    long q_strides[3];
    const int *cache_seqlens, *block_table;
    int *cta_start, *work_items;  // read (reuse, balanced), or written (self_schedule; direct mode: finish)
    long bt_stride;
    gl<float, 1, RUNTIME, RUNTIME, D> partial_out;  // (1, items, rows, D)
    float* partial_lse;
    int q_len, group, block_size, causal, window_left, window_right;
    float scale_log2, softcap;
    // direct: as many CTAs as slots, CTA c runs slot c, found from the slot rule and written to work_items
    // for the merge (small batches). Otherwise (not balanced) CTA c runs [cta_start[c], cta_start[c + 1]) of the
    // step's schedule, which it works out itself when Scheduling (else an earlier call of the step left it).
    bool direct;
    schedule_rule sched;
    // single: one item per (sequence, kv head) (max_splits 1), so finish writes out and lse itself and the
    // merge kernel is not launched. Otherwise an item that is its sequence's only one this step (the step's
    // chunk covers the sequence: slot_rule::whole) does the same, and the merge skips its segment.
    bool single;
    // balanced: CTA c runs its pieces of segments [cta_start[c], cta_start[c + 1]] (balanced_rule); whole pieces
    // write out / lse, the others their slot of partial_out / partial_lse.
    bool balanced;
    balanced_rule bal;
    T* out;
    long out_strides[3];
    float* lse;  // [batch, hq, q_len]
    int hq;
    const float* sinks;  // P.sinks: [hq] float32
    int head_dim;        // the columns of q and out (D, or less with ragged_head_dim)
    tk::attn_kv_descales descales;  // P.fp8_kv
  };
  struct input_block { kv_tile k, v; };
  // fp8: the converted ring (lcsf), whose stages the consumer computes on (fp8_q: V's only, beside the raw stage).
  struct converted_kv { mma_kv_tile k, v; };
  struct converted_v { mma_kv_tile v; };
  using converted_block = std::conditional_t<P.fp8_q, converted_v, converted_kv>;
  static constexpr int converted_stages = P.fp8_kv ? P.converted_stages : 0;
  static constexpr bool reads_raw_stage = P.fp8_q;
  static constexpr bool defers_converted = P.fp8_q;  // step j's products read V only of tile j - 1 (S_j: raw K_j)
  using compute_block = std::conditional_t<
      P.fp8_q, lcsf::both_stages<input_block, converted_block>,
      std::conditional_t<P.fp8_kv, converted_block, input_block>>;
  // The tiles a step's products read: K for S (fp8_q: the raw e4m3 one), V for P V.
  __device__ static const auto& keys(const compute_block& in) {
    if constexpr (P.fp8_q) return in.raw.k;
    else return in.k;
  }
  __device__ static const mma_kv_tile& values(const compute_block& in) {
    if constexpr (P.fp8_q) return in.converted.v;
    else return in.v;
  }
  struct scratch_block { q_tile q; };
  using s_tile = rt_fl<16, KV>;
  using row_vec = typename s_tile::per_row;
  struct consumer_state {
    rt_fl<16, D> o;
    rt<mma_t, 16, KV> p;
    row_vec m, l, rescale;
    bool rescale_o;  // whether o must take `rescale` (lazy rescaling: no row's max moved, see RESCALE_THRESHOLD)
    const mma_kv_tile* v_prev;
    float scale_log2, out_scale;  // P.fp8_kv: the task's score scale (descales folded in) and output scale
  };
  struct task_t { int item, b, h, start, end, base, len, iters; };

  // Every thread of the CTA calls it (lcsf), so self_schedule may use the whole block.
  __device__ static int2 task_range(const globals& g, int cta, int ctas) {
    if constexpr (Source == schedule_source::self) {
      return self_schedule<(consumers + 1) * WARPGROUP_THREADS>(g.sched, g.work_items, g.cta_start, cta, ctas);
    } else {
      if (g.direct) return {cta, cta + 1};
      if (g.balanced) return {g.cta_start[cta], min(g.cta_start[cta + 1] + 1, g.bal.batch * g.bal.hkv)};
      return {g.cta_start[cta], g.cta_start[cta + 1]};
    }
  }
  __device__ static int task_count(const globals&) { return 0; }  // unused: task_range decides
  // After a segment's last item (or an empty slot) the walk goes straight to the next segment's first slot: a
  // segment's used slots come first, and a step's chunk can leave most of them empty (short contexts under a
  // max_model_len-wide table, or any coarsened step), each of which would otherwise cost a dependent load.
  __device__ static int next_task(const globals& g, const task_t& t, int id) {
    if (g.direct || g.balanced || (t.end > t.start && t.end < g.sched.slots.clamped(t.len))) return id + 1;
    return (id / g.sched.slots.max_splits + 1) * g.sched.slots.max_splits;
  }
  __device__ static task_t task(const globals& g, int id, int) {
    if (g.balanced) {  // the piece of segment `id` in this CTA's share; item = its slot (-1: whole)
      const int b = id / g.bal.hkv, h = id % g.bal.hkv;
      const int4 pc = g.bal.piece(blockIdx.x, b, h, g.bal.seq_at[g.bal.batch]);
      task_t t{pc.z, b, h, pc.x, pc.y, pc.x & ~(PIECE - 1), g.cache_seqlens[b], 0};
      t.iters = pc.y > pc.x ? ceil_div(pc.y - t.base, KV) : 0;
      return t;
    }
    const int4 w = g.direct ? g.sched.slots(id) : reinterpret_cast<const int4*>(g.work_items)[id];
    task_t t{id, w.x, w.y, w.z, w.w, w.z & ~(PIECE - 1), g.cache_seqlens[w.x], 0};
    t.iters = w.w > w.z ? ceil_div(w.w - t.base, KV) : 0;  // empty slots carry no work
    return t;
  }

  __device__ static void load(input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    expect_bytes(full, 2 * tma::bytes<kv_tile>());
    const int row = t.base + it * KV, last = (t.end - 1) & ~(PIECE - 1);  // pieces past the end re-read the last
    tk::attn::paged_pieces<KV / PIECE, P.page_lookups>(g.block_table + t.b * g.bt_stride, g.block_size,
                                       [&](int s) { return min(row + s * PIECE, last); },
                                       [&](int s, int page, int at_row) {
                                         const coord at{.b = page, .d = t.h, .row = at_row};
                                         tma::load_async(in.k.template row_block<PIECE>(s), g.k, at, full);
                                         tma::load_async(in.v.template row_block<PIECE>(s), g.v, at, full);
                                       });
  }

  __device__ static void init_state(consumer_state& s, int) {
    reset(s);
    s.scale_log2 = 0.f, s.out_scale = 1.f;  // finite before a first task (an empty one finishes with o = 0)
  }
  __device__ static void reset(consumer_state& s) {
    zero(s.o);
    fill(s.m, -INFINITY);
    zero(s.l);
  }
  __device__ static tk::attn::scoring scoring(const globals& g, const consumer_state& s) {
    return {P.fp8_kv ? s.scale_log2 : g.scale_log2, g.softcap};
  }
  // The task's descales (P.fp8_kv), read as it starts: q's and k's scale its scores, v's its output rows.
  __device__ static void load_descales(consumer_state& s, const globals& g, const task_t& t) {
    const tk::attn_kv_descales& d = g.descales;
    const auto at = [&](const float* x, const long* stride) { return x ? x[t.b * stride[0] + t.h * stride[1]] : 1.f; };
    s.scale_log2 = g.scale_log2 * at(d.q, d.q_strides) * at(d.k, d.k_strides);
    s.out_scale = at(d.v, d.v_strides);
  }
  // Keys of other items (past `end`) are hidden like keys past the sequence; the query of row r is r / group.
  __device__ static tk::attn::visibility<true> visibility(const globals& g, const task_t& t) {
    return {t.end, t.len - g.q_len, g.window_left, g.window_right, g.group, bool(g.causal)};
  }

  // The packed query tile: row r = t * group + g holds q[b, t, h * group + g]; rows past q_len * group are 0.
  // (fp8: as fp16; fp8_q: as e4m3, as given.)
  __device__ static void load_queries(scratch_block& scratch, const globals& g, const task_t& t) {
    constexpr int vecs_per_row = D * int(sizeof(q_elem_t)) / 16;
    const int rows = g.q_len * g.group;
    for (int v = warpgroup::thread(); v < ROWS * vecs_per_row; v += WARPGROUP_THREADS) {
      const int r = v / vecs_per_row, col = (v % vecs_per_row) * (16 / int(sizeof(q_elem_t)));
      uint4 x{0, 0, 0, 0};
      if (r < rows && (!P.ragged_head_dim || col < g.head_dim)) {
        const int tok = r / g.group, head = t.h * g.group + r % g.group;
        x = *reinterpret_cast<const uint4*>(g.q + t.b * g.q_strides[0] + tok * g.q_strides[1] +
                                            head * g.q_strides[2] + col);
      }
      if constexpr (P.fp8_kv && !P.fp8_q) x = to_half_unit<T>(x);  // the products' type
      detail::st_shared_16B(scratch.q.ref().addr(r, col), x);
    }
    publish();  // the tile is read by wgmma next
  }
  // The warpgroup's shared-memory writes, visible to its wgmma: the proxy fence, then the warpgroup barrier.
  __device__ static void publish() {
    fence_async_shared();
    warpgroup::sync(1);
  }
  // fp8: the converted ring's stage `it` (lcsf: convert_stage), its rows past the item's end zeroed.
  __device__ static void convert_stage(converted_block& dst, const input_block& src, const globals&, const task_t& t,
                                       int it, int thread) {
    const int valid = t.end - (t.base + it * KV);
    if constexpr (!P.fp8_q) dequantize<lcsf::CONVERTER_THREADS>(dst.k, src.k, valid, thread);
    dequantize<lcsf::CONVERTER_THREADS>(dst.v, src.v, valid, thread);
  }

  // Only the packed rows q_len * group hold queries (4 or 8 of the 64 at q_len 1 and GQA groups of 4 / 8): a warp
  // with none skips the softmax (its zero queries' scores stay 0, so P = 0 and o stays 0: never written out),
  // and one with at most 8 works on the first 8 of its 16 rows (the other 8 scores stay 0 likewise).
  __device__ static void softmax(consumer_state& s, s_tile& att, const globals& g, const task_t& t, int it) {
    const int row0 = warpgroup::warp() * 16, live = g.q_len * g.group - row0;
    if (live <= 0) {
      s.rescale_o = false;
      return;
    }
    constexpr tk::attn::softmax_step all_rows{.lazy_rescale = true}, first_eight{.lazy_rescale = true, .row_slots = 1};
    if (live <= 8)
      s.rescale_o = tk::attn::online_softmax<first_eight>(att, s.m, s.l, s.rescale, scoring(g, s), visibility(g, t),
                                                          row0, t.base + it * KV);
    else
      s.rescale_o = tk::attn::online_softmax<all_rows>(att, s.m, s.l, s.rescale, scoring(g, s), visibility(g, t),
                                                       row0, t.base + it * KV);
  }

  __device__ static void compute_first(consumer_state& s, compute_block& in, scratch_block& scratch,
                                       const globals& g, const task_t& t, int) {
    if constexpr (P.fp8_kv) load_descales(s, g, t);
    load_queries(scratch, g, t);
    s_tile att;
    warpgroup::mm_ABt(att, scratch.q, keys(in));
    warpgroup::mma_async_wait<0>();
    softmax(s, att, g, t, 0);
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = &values(in);
  }

  // Tile j: S_j and the previous tile's P V go out together; the softmax of S_j overlaps that P V.
  __device__ static void compute(consumer_state& s, compute_block& in, scratch_block& scratch, const globals& g,
                                 const task_t& t, int it, int) {
    s_tile att;
    warpgroup::mm_ABt(att, scratch.q, keys(in));
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    warpgroup::mma_async_wait<1>();
    softmax(s, att, g, t, it);
    warpgroup::mma_async_wait<0>();
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = &values(in);
  }

  // Before the last P V: the tile's rows past the item's end are masked (P = 0), but at the sequence's end
  // they hold whatever the page held before, and 0 * NaN is NaN in P V, so they are zeroed first.
  // (fp8: convert zeroed them.)
  __device__ static void drain(consumer_state& s, scratch_block&, const globals&, const task_t& t, int) {
    if constexpr (!P.fp8_kv) {
      const int tail = t.end - (t.base + (t.iters - 1) * KV);
      if (tail < KV) warpgroup::zero_rows(s.v_prev->ref(), tail, 1);
    }
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    wgmma::fence_operand(s.p);
  }

  // o normalised (and, fp8, times v's descale) and the rows' LSE.
  __device__ static void finalize(consumer_state& s, row_vec& lse, const globals& g) {
    tk::attn::finalize(s.o, lse, s.m, s.l, scoring(g, s));
    if constexpr (P.fp8_kv) mul(s.o, s.o, s.out_scale);
  }

  // Row r of the item is query token r / group of head h * group + r % group: out[b, token, head, :] and
  // lse[b, head, token], each thread writing its two rows' column pairs.
  __device__ static void write_output(consumer_state& s, const globals& g, const task_t& t) {
    row_vec lse;
    finalize(s, lse, g);
    using F = frag<row_l>;
    const int rows = g.q_len * g.group, r0 = warpgroup::warp() * 16;
    if constexpr (P.sinks) {  // the rows' heads' sinks (padding rows: any finite value)
      row_vec sink;
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const int r = r0 + F::row(half, 0);
        sink.data[0][half] = r < rows ? g.sinks[t.h * g.group + r % g.group] : 0.f;
      }
      tk::attn::apply_sinks(s.o, lse, sink);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int r = r0 + F::row(half, 0);  // fragment registers k = half, half + 2: rows +0 / +8
      if (r >= rows) continue;
      const int tok = r / g.group, head = t.h * g.group + r % g.group;
      T* row = g.out + t.b * g.out_strides[0] + tok * g.out_strides[1] + head * g.out_strides[2];
#pragma unroll
      for (int j = 0; j < D / 16; j++)
#pragma unroll
        for (int k = half; k < 4; k += 2)
          if (!P.ragged_head_dim || 16 * j + F::col(k, 0) < g.head_dim)
            *reinterpret_cast<packed<T>*>(row + 16 * j + F::col(k, 0)) = convert<packed<T>>(s.o.data[0][j][k]);
      if (laneid() % 4 == 0) g.lse[(long(t.b) * g.hq + head) * g.q_len + tok] = lse.data[0][half];
    }
  }

  __device__ static void finish(consumer_state& s, scratch_block&, const globals& g, const task_t& t, int) {
    wgmma::fence_operand(s.p);
    if (g.direct && !g.single && warpgroup::thread() == 0)
      reinterpret_cast<int4*>(g.work_items)[t.item] = make_int4(t.b, t.h, t.start, t.end);
    // single: an empty item (no visible key) finalizes to out 0 and lse -inf, as the merge would.
    if (g.single || g.sched.slots.whole(t.b, t.start, t.end)) {
      write_output(s, g, t);
      reset(s);
      return;
    }
    if (t.iters > 0) {
      const int rows = g.q_len * g.group;
      row_vec lse;
      finalize(s, lse, g);
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

}  // namespace tk::decode
