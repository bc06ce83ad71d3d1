// Attention prefill on kittens (varlen, causal, sliding window, softcap, GQA, paged K/V).
//
// A task is (sequence, query head, 128- or 192-row query block); tasks run longest-first on a persistent
// grid. The producer warpgroup streams K and V tiles through a TMA ring (and at D=64 each task's queries, see
// q_ahead): one box per tile for packed K/V, one box per 16-row page piece for paged caches (16 divides every
// supported block size). Each consumer warpgroup owns 64 query rows: S = Q K^T on tensor cores, an online
// softmax in exp2 with the scale folded in (masks only on tiles that need them), then O += P V with P straight
// from registers. The consumers (two, or three: three_consumers) take turns on the tensor cores, and each
// overlaps its softmax with its previous P V (except three at D=128: `serial`).
#include <algorithm>
#include <variant>
#include "../kittens/kittens.cuh"
#include "attention.h"
#include "attention_common.cuh"

using namespace kittens;

namespace {

using tk::attn::LOG2E;

template <typename T, int D, int C, bool Claims, bool FastSerial, bool Capped = true>
struct attn_prefill {
  // C consumers, 64 query rows each. Three (D=64 and D=128; 192 queries a task): each K/V tile loaded serves
  // 1.5x the queries of two. D=128 then has 160 registers a thread, too few to hold the next tile's scores
  // beside the previous tile's probabilities: its consumers run each tile's S = Q K^T, softmax and P V in
  // turn (`serial`), and the other two consumers' products keep the tensor cores busy meanwhile
  // (ThunderKittens' H100 forward); D=64 keeps the overlapped order. With serial tiles a stage is free once
  // its P V is done (release lag 0), so two stages keep a tile in flight.
  static_assert(C == 2 || (C == 3 && D <= 128), "two consumers, or three at D <= 128");
  static constexpr int consumers = C, QROWS = 64, BQ = consumers * QROWS;
  static constexpr bool serial = C == 3 && D == 128;
  // Claims: tasks are claimed (lcsf's dynamic tasks), not strided: causal tasks differ in length, and a CTA
  // that drew short ones takes more instead of idling while another runs long ones. tk::attn_varlen_claims
  // says when: causal masks at D=256, and over dense K/V at D=128 with three consumers. Measured (session 10, same-call
  // A/Bs): D=256 causal 0.84-0.96 of the stride order's time; three claiming consumers at D=128 causal
  // n=4096 / 16384 0.96 / 0.90, varlen 0.93. But full masks (equal tasks) 1.03-1.04 at D=256, D=64/128 causal
  // at n <= 4096 with two consumers 1.01-1.05, D=64 with three 1.02-1.06, and paged K/V with three 1.065:
  // those keep the stride order. (Beside three consumers the claim loop makes the producer spill 24 bytes.)
  static constexpr bool dynamic = Claims;
  // D=64: the producer hands each task to the consumers (lcsf's fed tasks): ~150 instructions less a task in every
  // consumer warp, and no wait for the task's loads (the prefetched task's were waited for right away: ptxas moves
  // them to uniform registers as they arrive).
  static constexpr bool fed_tasks = D == 64;
  // Otherwise consumers read the next task (cu_seqlens and the like) one task ahead (lcsf). Same-call A/B (session
  // 21), the time without it over with: full masks 1.007-1.025, D=64 causal n=16384 1.018; D=256 full 0.979-0.992
  // (noise?).
  static constexpr bool prefetch_task = !Claims && D != 256 && !fed_tasks;
  static constexpr int release_lag = serial ? 0 : 1;
  // K/V tile rows and ring depth: what shared memory holds next to Q. At D=64 and D=128 a ring slot holds a
  // K/V pair, freed as one. At D=256 K and V take separate slots (lcsf's staggered pairs, FA3's tile and
  // release order): K_j goes back as soon as S_j = Q K_j^T has run, V_j once P_j V_j has, so the producer
  // refills a K slot half a tile earlier, and 4 slots of 80 rows (2 K/V tiles) fit where coupled pairs
  // would have to be 48 rows to keep 3 of them. D=128 with two consumers (over <= 1024 keys) staggers
  // 4 slots of 128 rows, FA3's hdim-128 layout, with queries ahead: causal n=1024 0.960 of coupled pairs without
  // queries ahead (session 21; 6 slots with the queries' own buffer 0.992). (Staggered slots with main's tiles
  // measured 1-4% slower at D=64 and 44% slower paged at D=128 with three consumers, which keep their pairs.)
  static constexpr bool staggered = D == 256 || (D == 128 && C == 2);
  // (D=64 on 64-key tiles and 8 stages, which waste no half tile on the diagonal: 1.06-1.16x the time, session 33.)
  static constexpr int KV = D == 256 ? 80 : 128;
  static constexpr int stages = D == 128 ? (serial ? 2 : staggered ? 4 : 3) : 4;
  static constexpr int SLOTS = staggered ? 2 : 1;  // ring slots a K/V tile takes
  static constexpr int PAGE_PIECE = 16;
  using q_tile = st<T, QROWS, D>;
  using kv_tile = st<T, KV, D>;
  using page_piece = st<T, PAGE_PIECE, D>;
  using tokens_gl = gl<T, 1, RUNTIME, RUNTIME, D, q_tile>;   // (1, heads, tokens, D)
  // D=64: each warp stores its own 16 rows of the output and frees its part of the queries (warp_epilogue): two
  // warpgroup barriers a task fewer (alone 0.987-1.008 in the A/B of fresh_first, which gives the pair's numbers).
  static constexpr bool warp_epilogue = D == 64;
  using out_rows = st<T, 16, D>;
  using out_gl = std::conditional_t<warp_epilogue, gl<T, 1, RUNTIME, RUNTIME, D, q_tile, out_rows>, tokens_gl>;
  using kv_gl = gl<T, 1, RUNTIME, RUNTIME, D, kv_tile>;      // (1, heads, tokens, D)
  using pages_gl = gl<T, RUNTIME, RUNTIME, RUNTIME, D, page_piece>;  // (blocks, heads, block_size, D)

  struct globals {
    tokens_gl q;
    out_gl o;
    kv_gl k, v;
    pages_gl k_pages, v_pages;
    float* lse;
    long lse_stride;
    const int *cu_q, *cu_k, *seqused_k, *block_table;
    long bt_stride;
    int batch, hq, group, q_blocks, block_size, paged, causal, window_left, window_right;
    int heads_per_group;  // (sequence, head) pairs whose K/V fit in L2 together (see task)
    // task's and load's divisors: the grid, a group's tasks, its heads (the last group's may be fewer), the query
    // heads, and the query heads a kv head serves. The compiler's divisions took ~5% of the D=64 consumers' stall
    // samples at n=1024 (~20 dependent instructions each, four in a row at every task's start); same-call A/B
    // (session 30): 0.965-0.991 of their time on 20 of the 22 bench cases.
    divisor ctas_div, per_group_div, group_heads_div, last_group_heads_div, hq_div, group_div;
    float scale_log2, softcap;  // softcap > 0: scores = softcap * tanh(qk * scale / softcap)
    int* task_counter;          // lcsf's dynamic tasks
    divisor block_size_div;     // paged: a page's tokens (see paged_block)
  };
  struct kv_pair { kv_tile k, v; };
  struct kv_slot { kv_tile kv; };  // staggered: K_j in an even slot, V_j in the next
  using input_block = std::conditional_t<staggered, kv_slot, kv_pair>;
  // A step's K_j, and the V_j its P_j V_j will use one step later.
  __device__ static const kv_tile& k_of(const input_block& in) {
    if constexpr (staggered) return in.kv;
    else return in.k;
  }
  __device__ static const kv_tile* v_of(const input_block& in) {
    if constexpr (staggered) return &(&in)[1].kv;  // the ring slot after K_j's
    else return &in.v;
  }
  // Queries ahead (D=64, and D=128 with two consumers): the producer loads each consumer's queries (load_task_inputs)
  // once the consumer has run its last S = Q K^T of the task before (q_free), so they arrive under that task's last
  // softmax, P V and output, and the output is staged in a buffer of its own on the way to its TMA store. Otherwise a
  // consumer loads its queries as it starts a task and stages the output in their buffer. Same-call A/B on the H200
  // (session 14), ahead over own: D=64 n=1024 / 4096 full 0.973 / 0.979, causal 0.918 / 0.968, n=16384 0.996-0.998. At
  // D=128 (three consumers: the second buffers fill shared memory to 224 KB) n=1024 full 0.971 and paged 0.96-0.97,
  // but n=4096 / 16384 full 1.023 / 1.011 and, with claimed tasks (the producer then spills ~250 bytes), causal
  // 1.016-1.048; so of D=128 only the two-consumer kernel (staggered, see above) has them. D=256 has no room for the
  // buffers.
  static constexpr bool q_ahead = D == 64 || (D == 128 && C == 2);
  static_assert(!warp_epilogue || q_ahead, "warp_epilogue: the output's own staging buffer (q_ahead)");
  static_assert(!q_ahead || stages * sizeof(input_block) + 2 * consumers * sizeof(q_tile) <= 224 * 1024);
  struct scratch_ahead {
    q_tile q[consumers], o[consumers];
    semaphore q_ready[consumers], q_free[consumers];
    unsigned q_free_phases;  // the producer's: bit c, the phase of q_free[c] it waits for next (flipped)
  };
  struct scratch_own {
    q_tile q[consumers];  // this task's queries; the output is staged here on the way out
    semaphore q_ready[consumers];
  };
  using scratch_block = std::conditional_t<q_ahead, scratch_ahead, scratch_own>;
  // Whether a consumer works out once a task which of its tiles need the mask (visibility::mask_span), instead of
  // testing each tile: 13 instructions fewer a tile at D=64. Same-call A/B on the H200 (session 24, two rounds):
  // D=64 causal n=1024 / 4096 (two consumers) 0.970 / 0.984, D=128 causal n=1024 0.995, varlen / paged 0.991, the
  // rest within 0.5%. Serial (160 registers) spilled with the two more live registers; D=256 measured 1-3% slower
  // in a one-round A/B (noisy), so both keep the test a tile.
  static constexpr bool mask_once = !serial && D <= 128;
  // Whether a warp skips the softmax of a tile that hides every key from its 16 rows, or whose rows have no output
  // (P = 0 then, and its row max and sum stay): under a causal mask the tiles past a warp's rows (9% of D=64's
  // warp tiles at n=1024: 192-row blocks, so a task's last tile may lie wholly past its first warps' rows), and
  // the rows before a sequence's start (a ragged first block's idle consumers). Same-call A/B on the H200 (session
  // 30, two rounds): D=64 causal n=1024 0.975, the rest 0.997-1.012 (drift <= 1.011); the idle rows' skip gained
  // nothing at full masks (1.006), so the softmax is not what bounds a tile there. D=64 only: a two-consumer
  // D=128 block's last tile always holds a key its first warp sees.
  static constexpr bool skip_hidden = mask_once && D == 64;
  using s_tile = rt_fl<16, KV>;
  using row_vec = typename s_tile::per_row;
  struct consumer_state {
    rt_fl<16, D> o;
    rt<T, 16, KV> p;        // the previous tile's probabilities, waiting for their P V
    row_vec m, l;           // running row max (score units) and row sum
    row_vec rescale;        // factor o must take before the previous tile's P V is added
    bool rescale_o;         // whether any row's is not 1 (warp-uniform; see tk::attn::RESCALE_THRESHOLD)
    const kv_tile* v_prev;  // that tile's V: its stage stays held until the current compute returns
    int q_phase;
    int seen_lo, seen_hi;   // serial: the task's tiles [seen_lo, seen_hi) hold keys this consumer's rows see
    int own;                // trims: the task's tiles this consumer computes (own_iters)
    bool half;              // half_last: the last of them is a half tile (its rows see none of its last 64 keys)
    // Which of the task's tiles this warp's rows mask (compute_first), where mask_once.
    [[no_unique_address]] std::conditional_t<mask_once, tk::attn::visibility<>::span, std::monostate> mask;
  };
  struct task_t {
    int b, h, row0, q0, lq, k0, lk, lo, first, iters;  // row0: the block's first query row (< 0: see task)
    // lo: the first key any of the task's queries sees
    // iters: ring slots, SLOTS a K/V tile
    bool valid;
  };
  // The consumers take turns issuing their matrix products, round robin (barriers TURN + consumer, after the
  // warpgroups' own 1..consumers), so one's softmax runs while another's products keep the tensor cores busy.
  static constexpr int TURN = 1 + consumers, BOTH = 2 * WARPGROUP_THREADS;
  __device__ static int next_turn(int wg) { return TURN + (wg + 1 == consumers ? 0 : wg + 1); }

  __device__ static void init_scratch(scratch_block& s) {
    for (int c = 0; c < consumers; c++) init_semaphore(s.q_ready[c], 1);
    if constexpr (q_ahead) {
      for (int c = 0; c < consumers; c++) init_semaphore(s.q_free[c], warp_epilogue ? WARPGROUP_WARPS : 1);
      s.q_free_phases = 0;
    }
  }
  // Accumulators start each task empty; finish puts them back (no non-wgmma writes to them mid-pipeline).
  __device__ static void reset_accumulators(consumer_state& s) {
    zero(s.o);
    fill(s.m, -INFINITY);
    zero(s.l);
  }
  __device__ static void init_state(consumer_state& s, int wg) {
    reset_accumulators(s);
    s.q_phase = 0;
    s.v_prev = nullptr;
    if (wg == consumers - 1) warpgroup::arrive_at(TURN + 0, BOTH);  // consumer 0 goes first
  }
  // Capped = false: launched without a softcap (its code compiled out).
  __device__ static tk::attn::scoring scoring(const globals& g) { return {g.scale_log2, Capped ? g.softcap : 0.f}; }

  __device__ static int task_count(const globals& g) { return g.q_blocks * g.batch * g.hq; }
  // Task order, L2-aware: (sequence, head) pairs go in groups of heads_per_group, whose K/V fit in L2 together;
  // within a group the query blocks go latest (longest under a causal mask) first, the group's heads
  // interleaved, so the CTAs running at once stream the same few heads' K/V and read them from L2. (Head-major
  // over all pairs would give every CTA its own head and make the kernel HBM-bound.) Under a causal mask the
  // stride order's odd waves run reversed (zigzag), so each CTA's long and short tasks alternate: otherwise the
  // stride hands some CTAs the longer tasks of every group, and the CTAs drift apart and read groups no longer in
  // L2. ncu at D=64 causal b16 h32 n=4096 (session 29), plain stride: SMs active 84% of the kernel's time, L2 hit
  // rate 40% (FA3 99% / 79%); claimed tasks brought it to 98% / 77% and 0.915 of the time, and zigzag to 0.933 of
  // the claimed tasks' time (same-call A/Bs, two rounds; D=64 causal n=1024 / 16384 1.001 / 0.994), 97% / 75%.
  // Without a mask, D=64 turns each full wave by heads_per_group places a wave (rotation): a group of one wave puts
  // the same query block on the same CTAs every wave, and the ragged first blocks, cheap since their idle consumers
  // sit out (trims), would all go to the same CTAs while the others ran full blocks only. (Measured with trims only,
  // see there.)
  __device__ static task_t task(const globals& g, int id, int) {
    task_t t;
    // D=64 only: the serial kernel spilled 132 bytes with it (its dense causal tasks claim), and the two-consumer
    // D=128 kernel measured causal n=1024 1.016 in the A/B (base drift 1.023) and 1.046 bench to bench (FA3 within
    // 0.4%). ptxas's allocation is fragile here: with the index written wave * ctas + ctas - 1 - ..., the D=64
    // consumers spilled 96 bytes.
    if constexpr (D == 64) {
      const int ctas = gridDim.x, wave = g.ctas_div.div(id), at = id - wave * ctas;
      if ((wave + 1) * ctas <= task_count(g)) {
        if (g.causal) {
          if (wave & 1) id = wave * ctas + (ctas - 1) - at;
        } else {
          int r = at + g.ctas_div.mod(wave * g.heads_per_group);
          if (r >= ctas) r -= ctas;
          id = wave * ctas + r;
        }
      }
    }
    const int heads = g.batch * g.hq, per_group = g.heads_per_group * g.q_blocks;
    const int group = g.per_group_div.div(id), first = group * g.heads_per_group, in_group = id - group * per_group;
    const divisor& group_heads = heads - first < g.heads_per_group ? g.last_group_heads_div : g.group_heads_div;
    const int qb = g.q_blocks - 1 - group_heads.div(in_group);
    const int pair = first + group_heads.mod(in_group);  // consecutive q heads share a kv head under GQA
    t.b = g.hq_div.div(pair);
    t.h = pair - t.b * g.hq;
    t.q0 = g.cu_q[t.b];
    t.lq = g.cu_q[t.b + 1] - t.q0;
    t.lk = g.seqused_k ? g.seqused_k[t.b] : g.cu_k[t.b + 1] - g.cu_k[t.b];
    t.k0 = g.paged ? 0 : g.cu_k[t.b];
    // Query blocks align to the sequence's end (rounded up to QROWS rows): block qb ends q_blocks - 1 - qb blocks
    // before it. A sequence whose length is not a multiple of BQ then has its short block first, where under a
    // causal mask it sees the fewest keys, not last, where it sees the most; consumers whose rows all lie before
    // the sequence's start (row0 < 0) have nothing to write (the serial kernel leaves them idle). A consumer's
    // rows start at a multiple of QROWS, so none straddles the start; only the last can straddle the end.
    t.row0 = ceil_div(t.lq, QROWS) * QROWS - (g.q_blocks - qb) * BQ;
    t.valid = t.row0 + BQ > 0;
    const auto [begin, end] = key_range(g, t, t.row0, BQ);
    t.lo = begin;
    t.first = begin / KV;
    t.iters = (t.valid && end > begin) ? SLOTS * (ceil_div(end, KV) - t.first) : 0;
    return t;
  }
  struct keys_t { int begin, end; };
  // The keys queries row_lo .. row_lo + rows - 1 of a task's sequence see (those past its end see none).
  __device__ static keys_t key_range(const globals& g, const task_t& t, int row_lo, int rows) {
    const int offset = t.lk - t.lq;  // bottom-right alignment
    // The block's last row, before row_lo is clamped: a ragged first block's rows before the start see nothing
    // (clamped first, its causal key range ran 128 rows too far; same-call A/B, session 31: 0.984-1.008).
    const int row_hi = min(t.lq, row_lo + rows) - 1;
    row_lo = max(row_lo, 0);
    int begin = 0, end = t.lk;
    if (g.window_left >= 0) begin = max(0, row_lo + offset - g.window_left);
    if (g.causal) end = min(end, row_hi + offset + 1);
    if (g.window_right >= 0) end = min(end, row_hi + offset + g.window_right + 1);
    return {begin, end};
  }

  // The page size paged_pieces divides by: a divisor at D=128 (paged16 / paged64 0.954 / 0.963 of an integer
  // division's time, same-call A/B in session 30), the plain int elsewhere (with the divisor in every kernel, D=64
  // full n=1024 / 4096 measured 1.024 / 1.015: what it changed in their schedules, not in their paged loads).
  __device__ static auto paged_block(const globals& g) {
    if constexpr (D == 128) return g.block_size_div;
    else return g.block_size;
  }
  // Slot `it`: K/V tile it (a pair), or staggered K (even slot) or V (odd) of tile it / 2.
  __device__ static void load(input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    const int row = (t.first + it / SLOTS) * KV, kv_head = g.group_div.div(t.h);
    expect_bytes(full, (staggered ? 1 : 2) * tma::bytes<kv_tile>());
    if (!g.paged) {
      if constexpr (staggered) {  // a branch, not a select of the layouts: their descriptors stay in parameter space
        if (it & 1) tma::load_async(in.kv, g.v, {.d = kv_head, .row = t.k0 + row}, full);
        else tma::load_async(in.kv, g.k, {.d = kv_head, .row = t.k0 + row}, full);
      } else {
        tma::load_async(in.k, g.k, {.d = kv_head, .row = t.k0 + row}, full);
        tma::load_async(in.v, g.v, {.d = kv_head, .row = t.k0 + row}, full);
      }
      return;
    }
    // Pieces past the end re-read the last one, pieces before the window the window's first: every page read
    // belongs to the sequence (a sliding-window cache may have recycled the pages behind the window).
    const int last_piece = (t.lk - 1) / PAGE_PIECE * PAGE_PIECE, first_piece = t.lo / PAGE_PIECE * PAGE_PIECE;
    tk::attn::paged_pieces<KV / PAGE_PIECE>(
        g.block_table + t.b * g.bt_stride, paged_block(g),
        [&](int s) { return max(min(row + s * PAGE_PIECE, last_piece), first_piece); },
        [&](int s, int page, int at_row) {
          const coord at{.b = page, .d = kv_head, .row = at_row};
          if constexpr (staggered) {
            if (it & 1) tma::load_async(in.kv.template row_block<PAGE_PIECE>(s), g.v_pages, at, full);
            else tma::load_async(in.kv.template row_block<PAGE_PIECE>(s), g.k_pages, at, full);
          } else {
            tma::load_async(in.k.template row_block<PAGE_PIECE>(s), g.k_pages, at, full);
            tma::load_async(in.v.template row_block<PAGE_PIECE>(s), g.v_pages, at, full);
          }
        });
  }

  // A consumer reads queries in a task (and frees them after its last S) iff it has rows and the task has keys.
  __device__ static bool reads_queries(const task_t& t, int wg) { return t.iters > 0 && !idle(t, wg); }
  __device__ static void load_task_inputs(scratch_block& scratch, const globals& g, const task_t& t)
    requires q_ahead
  {
    unsigned phases = scratch.q_free_phases;
#pragma unroll
    for (int c = 0; c < consumers; c++) {
      if (!reads_queries(t, c)) continue;
      wait(scratch.q_free[c], ((phases >> c) & 1) ^ 1);  // a fresh semaphore passes at once
      phases ^= 1u << c;
      expect_bytes(scratch.q_ready[c], tma::bytes<q_tile>());
      // A consumer whose rows lie before its sequence's start loads some (clamped into the tensor); it writes none.
      tma::load_async(scratch.q[c], g.q, {.d = t.h, .row = max(t.q0 + t.row0 + c * QROWS, 0)}, scratch.q_ready[c]);
    }
    scratch.q_free_phases = phases;
  }
  // After the task's last S: the queries' buffer may take the next task's.
  __device__ static void free_queries(scratch_block& scratch, const consumer_state& s, const task_t& t, int it, int wg) {
    if constexpr (q_ahead) {
      if (it != last_tile(s, t)) return;
      if constexpr (warp_epilogue) {  // each warp, once its part of S has read them
        __syncwarp();
        if (laneid() == 0) arrive(scratch.q_free[wg]);
        return;
      }
      warpgroup::sync(1 + wg);  // every warp's part of S has read them
      if (warpgroup::thread() == 0) arrive(scratch.q_free[wg]);
    }
  }

  // Tile j: S_j = Q K_j^T and the previous tile's O += P_{j-1} V_{j-1} are issued together in this
  // consumer's turn; the softmax of S_j then runs while P_{j-1} V_{j-1} (and the other consumer) compute.
  // (Staggered, lcsf calls this once a K/V tile, `it` = j, with K_j's slot; V_{j-1}'s is held too.)
  __device__ static void compute(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                 const task_t& t, int it, int wg) {
    if constexpr (serial) {
      serial_tile<true>(s, in, scratch, g, t, it, wg);
      return;
    }
    if constexpr (half_last) {
      if (s.half && it == s.own - 1) return overlapped_tile<HALF>(s, in, scratch, g, t, it, wg);
    }
    overlapped_tile<KV>(s, in, scratch, g, t, it, wg);
  }
  // The overlapped order's tile `it` on its first Cols keys (KV, or HALF: see half_last).
  template <int Cols>
  __device__ static void overlapped_tile(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                         const task_t& t, int it, int wg) {
    rt_fl<16, Cols> att;
    warpgroup::sync_with(TURN + wg, BOTH);
    warpgroup::mm_ABt(att, scratch.q[wg], keys<Cols>(in));
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);  // o is idle here: only S_j is in flight
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);  // the previous tile is a whole one (a half tile is a consumer's last)
    warpgroup::arrive_at(next_turn(wg), BOTH);
    warpgroup::mma_async_wait<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
    softmax<true>(s, att, scratch, in, g, t, it, wg);
    free_queries(scratch, s, t, it, wg);  // after the softmax, which may run S_j again
    warpgroup::mma_async_wait<0>();  // P_{j-1} V_{j-1} is done: p is free
    wgmma::fence_operand(s.p);
    copy_leading(s.p, att);
    s.v_prev = v_of(in);
  }
  // K_j's first Cols rows (keys).
  template <int Cols> __device__ static auto keys(const input_block& in) {
    if constexpr (Cols == KV) return k_of(in).ref();
    else return k_of(in).template row_block<Cols>(0);
  }

  // A task's first tile: the queries (loaded here unless q_ahead), then S_0 alone.
  __device__ static void compute_first(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                       const task_t& t, int wg) {
    if constexpr (trims) s.own = own_iters(g, t, wg);
    if constexpr (half_last) s.half = s.own > 1 && last_keys(g, t, wg) - (t.first + s.own - 1) * KV <= HALF;
    if constexpr (mask_once) {
      const int row0 = rows_of(t, wg);
      s.mask = visibility(g, t).mask_span(row0, s_tile::rows, KV);
      if (skip_hidden && (row0 >= t.lq || row0 + s_tile::rows <= 0)) s.mask.hidden_after = INT_MIN;  // no output
    }
    if (reads_queries(t, wg)) {
      if (!q_ahead && warpgroup::thread() == 0) {
        tma::store_wait_read<0>();  // the previous task's output has left the buffer
        expect_bytes(scratch.q_ready[wg], tma::bytes<q_tile>());
        tma::load_async(scratch.q[wg], g.q, {.d = t.h, .row = max(t.q0 + t.row0 + wg * QROWS, 0)}, scratch.q_ready[wg]);
      }
      wait(scratch.q_ready[wg], s.q_phase);
      s.q_phase ^= 1;
    }
    if constexpr (serial) {
      s.seen_lo = s.seen_hi = 0;
      if (!idle(t, wg)) {
        const auto [begin, end] = key_range(g, t, t.row0 + wg * QROWS, QROWS);
        if (end > begin) {
          s.seen_lo = begin / KV - t.first;
          s.seen_hi = ceil_div(end, KV) - t.first;
        }
      }
      serial_tile<false>(s, in, scratch, g, t, 0, wg);
      return;
    }
    s_tile att;
    warpgroup::sync_with(TURN + wg, BOTH);
    warpgroup::mm_ABt(att, scratch.q[wg], k_of(in));
    warpgroup::arrive_at(next_turn(wg), BOTH);
    warpgroup::mma_async_wait<0>();
    if constexpr (!seeded_first) free_queries(scratch, s, t, 0, wg);
    softmax<false>(s, att, scratch, in, g, t, 0, wg);
    if constexpr (seeded_first) free_queries(scratch, s, t, 0, wg);  // after the softmax, which may run S_0 again
    wgmma::fence_operand(s.p);
    copy(s.p, att);
    s.v_prev = v_of(in);
  }

  // Serial order (see `serial`): tile `it`'s scores, softmax and P V, all done on return. Its rows past the
  // sequence's end are zeroed in V first on the last tile (see drain).
  template <bool Fast>
  __device__ static void serial_tile(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                     const task_t& t, int it, int wg) {
    s_tile att;
    warpgroup::sync_with(TURN + wg, BOTH);
    if (it < s.seen_lo || it >= s.seen_hi) {  // none of its rows sees this tile: keeps its turn, skips the work
      warpgroup::arrive_at(next_turn(wg), BOTH);
      return;
    }
    warpgroup::mm_ABt(att, scratch.q[wg], k_of(in));
    warpgroup::arrive_at(next_turn(wg), BOTH);
    warpgroup::mma_async_wait<0>();
    softmax<Fast>(s, att, scratch, in, g, t, it, wg);
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    rt<T, 16, KV> p;
    copy(p, att);
    if (it == t.iters - 1) zero_tail(v_of(in), t, wg);
    warpgroup::mma_AB(s.o, p, *v_of(in));
    warpgroup::mma_async_wait<0>();
  }
  // Serial order: a consumer whose 64 rows all lie before the sequence's start (the first query block of a
  // sequence that is not a multiple of 192 long, see task) or past its end loads and computes nothing, and one
  // skips the tiles none of its rows sees (seen_lo / seen_hi): a task's tiles cover all 192 rows' keys, and under
  // a causal mask the first consumer's rows end 128 keys before the last's, so its last tile is often all masked
  // (a window's first tiles likewise). The overlapped D=64 order does the same at the task's end through lcsf
  // (trims); a window's leading tiles it computes.
  __device__ static bool idle(const task_t& t, int wg) {
    const int r0 = t.row0 + wg * QROWS;
    return (serial || trims) && (r0 >= t.lq || r0 < 0);
  }
  // Trims (D=64): a consumer computes only the tiles up to the last one its rows see (lcsf's own_iters), and sits
  // the task's later ones out, keeping its turns: an idle consumer (a ragged first block's: at n=1024, 2 of each
  // sequence's 18 consumer tasks) all of them, and under a causal mask a block's first consumers the last one or two
  // (9 of the 81 consumer tiles a sequence at n=1024). The overlapped order cannot skip a tile's products inside
  // compute: a branch around the wgmma serializes them (ptxas C7515). Same-call A/B on the H200 (session 31, two
  // rounds, with the full-mask rotation in task): n=1024 full / causal 0.957 / 0.976, n=4096 / 16384 0.995-1.008.
  // ptxas is fragile here: without the rotation the consumers spilled 84 bytes. Tried: a consumer that sits tiles
  // out leaving the turns and finishing first (1.005-1.014, lost); no turns at all for D=64 (0.990-1.002: the
  // turns cost nothing here); the task's output written after the next task's S_0 is issued (consumers spilled
  // 372 bytes).
  static constexpr bool trims = D == 64;
  __device__ static int own_iters(const globals& g, const task_t& t, int wg)
    requires trims
  {
    if (t.iters == 0 || idle(t, wg)) return 0;
    return min(t.iters, max(1, ceil_div(last_keys(g, t, wg), KV) - t.first));
  }
  // The end of the keys this consumer's rows see.
  __device__ static int last_keys(const globals& g, const task_t& t, int wg) {
    return key_range(g, t, t.row0 + wg * QROWS, QROWS).end;
  }
  __device__ static void sit_out(int wg)
    requires trims
  {
    warpgroup::sync_with(TURN + wg, BOTH);
    warpgroup::arrive_at(next_turn(wg), BOTH);
  }
  // The last of the task's tiles this consumer computes.
  __device__ static int last_tile(const consumer_state& s, const task_t& t) {
    if constexpr (trims) return s.own - 1;
    else return t.iters / SLOTS - 1;
  }
  __device__ static void zero_tail(const kv_tile* v, const task_t& t, int wg) {
    const int tail = t.lk - (t.first + t.iters / SLOTS - 1) * KV;
    if (tail < KV) warpgroup::zero_rows(v->ref(), tail, 1 + wg);
  }

  __device__ static tk::attn::visibility<> visibility(const globals& g, const task_t& t) {
    return {t.lk, t.lk - t.lq, g.window_left, g.window_right, 1, bool(g.causal)};
  }
  // The first of this warp's 16 rows of the task's queries.
  __device__ static int rows_of(const task_t& t, int wg) { return t.row0 + wg * QROWS + warpgroup::warp() * 16; }
  // Online softmax of one score tile in place (att becomes the unnormalised probabilities); updates the
  // running max and sum and leaves in s.rescale the factor the accumulated output must take.
  // Fast (a task's later tiles, below D=256): online_softmax's Fast path, which runs S = Q K^T again (K's stage and
  // the queries are still held) when the tile cannot take it. (At D=256 it made the consumers spill ~30 bytes.)
  // The serial kernel takes it without FastIfSeen (see online_softmax; with it, ~140 bytes of spill): a consumer
  // whose first tile is not the task's (a window's) runs that tile's S twice.
  // FastSerial: the serial kernel's later tiles take it too (launched under causal masks: see run_serial).
  static constexpr bool fast_softmax = D <= 128 && (!serial || FastSerial);
  // A task's first tile (compute_first) starts from empty rows (online_softmax's Fresh): D=64. With warp_epilogue,
  // same-call A/B on the H200 (session 32, two rounds): D=64 0.991-0.999 of the time (n=1024 full / causal 0.997 /
  // 0.993; alone: 0.985 / 1.003, base drift <= 1.027), the other kernels' SASS unchanged.
  static constexpr bool fresh_first = D == 64;
  // ... and, launched without a softcap (Capped = false), on the fast softmax against a guess at each row's max
  // (online_softmax's Fresh and Fast: the max of the tile's first 16 columns), the exact step only where the guess
  // fails the fast path's test. Same-call A/B on the H200 (session 34, two rounds): D=64 0.980-0.991 of the time
  // (n=1024 full / causal 0.980 / 0.991), the unchanged kernels 0.985-1.009. With a softcap's code beside it the
  // consumers spilled 100 bytes, so softcap launches take the Capped kernel, which keeps the exact first tile.
  static constexpr bool seeded_first = fresh_first && fast_softmax && !Capped;
  // Half last tile (D=64 without a softcap): where a consumer's rows see none of its last tile's last 64 keys (under
  // a causal mask, a diagonal tile whose rows start at a multiple of 128 keys: half of them at n=1024, 8 of the 72
  // tiles a sequence's consumers compute; a sequence ending in a tile's first half), that tile's S and P V run on
  // its first 64 keys only: half the products and exp2 of a whole tile. Same-call A/B on the H200 (session 35, two
  // rounds): D=64 causal n=1024 / 4096 / 16384 0.964 / 0.982 / 1.000, full 1.003-1.018 (the branch a tile; n=1024
  // 1.018), the unchanged kernels 0.957-1.018. (A consumer's only tile, compute_first's, stays whole.)
  static constexpr bool half_last = trims && seeded_first;
  static constexpr int HALF = KV / 2;
  template <bool Fast, typename S>
  __device__ static void softmax(consumer_state& s, S& att, scratch_block& scratch, const input_block& in,
                                 const globals& g, const task_t& t, int it, int wg) {
    const int row0 = rows_of(t, wg), col0 = (t.first + it) * KV;
    const auto vis = visibility(g, t);
    const auto masked = [&] {
      if constexpr (mask_once) return s.mask.masks(col0);
      else return vis.partial(row0, S::rows, col0, S::cols);
    };
    const auto recompute = [&](S& a) {
      warpgroup::mm_ABt(a, scratch.q[wg], keys<S::cols>(in));
      warpgroup::mma_async_wait<0>();
    };
    const auto group_all = [wg](bool pred) { return warpgroup::all(1 + wg, pred); };
    constexpr bool fresh = !Fast && fresh_first, fast = (Fast || seeded_first) && fast_softmax;
    if constexpr (skip_hidden) {
      if (s.mask.hides(col0)) {  // see skip_hidden
        s.rescale_o = false;
        if constexpr (fast) {
          if (!group_all(true)) {  // the group's recompute: every warp issues it, and its result must stay live
            recompute(att);
            map(att, att, [](float x) { return 0.f * x; });
            return;
          }
        }
        zero(att);
        return;
      }
    }
    s.rescale_o = tk::attn::online_softmax<!(serial && Claims), ~0u, fast, !serial, fresh>(
        att, s.m, s.l, s.rescale, scoring(g), vis, row0, col0, masked, recompute, group_all);
  }

  // The last tile's P V, issued while its V is still held. The tile's rows past the sequence's end hold
  // whatever the page held (paged) or the next sequence's keys: masked (P = 0), but 0 * NaN is NaN in P V,
  // so they are zeroed first. Each consumer clears them before its own P V (both write the same zeros).
  __device__ static void drain(consumer_state& s, scratch_block&, const globals&, const task_t& t, int wg) {
    if constexpr (serial) return;  // every tile's P V is done in its own compute
    if (last_tile(s, t) == t.iters / SLOTS - 1) zero_tail(s.v_prev, t, wg);
    if (s.rescale_o) mul_row(s.o, s.o, s.rescale);
    if constexpr (half_last) {
      if (s.half) {
        warpgroup::mma_AB_leading(s.o, s.p, s.v_prev->template row_block<HALF>(0));
        wgmma::fence_operand(s.p);
        return;
      }
    }
    warpgroup::mma_AB(s.o, s.p, *s.v_prev);
    wgmma::fence_operand(s.p);
  }

  __device__ static void finish(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t, int wg) {
    wgmma::fence_operand(s.p);
    const int r0 = t.row0 + wg * QROWS;
    if (t.valid && r0 >= 0 && r0 < t.lq) write_output(s, scratch, g, t, wg, r0);  // no visible key: out 0, lse -inf
    reset_accumulators(s);
  }

  __device__ static void write_output(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t,
                                      int wg, int r0) {
    row_vec lse;
    tk::attn::finalize<true>(s.o, lse, s.m, s.l, scoring(g));
    // lse: lanes 0, 4, ... hold rows g and g + 8 of each warp's 16
    if (laneid() % 4 == 0) {
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const int row = r0 + warpgroup::warp() * 16 + laneid() / 4 + 8 * half;
        if (row < t.lq) g.lse[t.h * g.lse_stride + t.q0 + row] = lse.data[0][half];
      }
    }
    if (r0 + QROWS <= t.lq) {  // a whole tile: through shared memory and one TMA store
      // The buffer's last store must have read it: with q_ahead, the previous task's output from o; else a task
      // without keys (no compute_first, which waits) may follow one whose output store still reads q.
      q_tile* staging;
      if constexpr (q_ahead) staging = &scratch.o[wg];
      else staging = &scratch.q[wg];
      if constexpr (warp_epilogue) {  // warp syncs only: the warp's rows, its own bulk-store group
        const auto rows = staging->template row_block<16>(warpgroup::warp());
        if (laneid() == 0) tma::store_wait_read<0>();
        __syncwarp();
        warp::store(rows, s.o);
        fence_async_shared();
        __syncwarp();
        if (laneid() == 0) {
          tma::store_async(g.o, rows, {.d = t.h, .row = t.q0 + r0 + 16 * warpgroup::warp()});
          tma::store_commit_group();
        }
        return;
      }
      if (q_ahead || t.iters == 0) {
        if (warpgroup::thread() == 0) tma::store_wait_read<0>();
        warpgroup::sync(1 + wg);
      }
      warpgroup::store(staging->ref(), s.o);
      fence_async_shared();
      warpgroup::sync(1 + wg);
      if (warpgroup::thread() == 0) {
        tma::store_async(g.o, *staging, {.d = t.h, .row = t.q0 + r0});
        tma::store_commit_group();
      }
    } else {  // the sequence ends inside this tile: write its rows only
      warpgroup::store_each(g.o, s.o, {.d = t.h, .row = t.q0 + r0}, long(t.q0) + t.lq);  // see store_each
    }
  }
};

// How many (sequence, q head) pairs go in one L2 group (see attn_prefill::task): at most the pairs whose K/V fit
// in half of L2 (the other half: Q, O and whatever else is live; q heads of one kv head share its K/V, so this
// counts kv heads' bytes), and without a causal mask at most the pairs whose query blocks make one wave of the
// grid. A group of several waves re-streams its heads' K/V once a wave: at n=4096, D=128 (12 heads a group, two
// waves) the kernel read ~3x the compulsory bytes from DRAM where FA3, whose dense tile order walks a head's
// query blocks together, read them once (ncu, session 17); one-wave groups took 0.97-0.99 of the time on dense
// masks. Under a causal mask the tasks differ in length and the waves do not stay in step: there one-wave
// groups measured 0.98-1.06 (session 17).
inline int heads_per_l2_group(const tk::attn_varlen_problem& p, int head_dim, int q_blocks, int ctas) {
  int device = 0, l2_bytes = 0;
  TK_CUDA_CHECK(cudaGetDevice(&device));
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const long kv_bytes = std::max<long>(1, long(p.max_seqlen_k) * head_dim * 2 * 2);  // K and V, 16-bit
  const long kv_heads = std::max<long>(1, (l2_bytes / 2) / kv_bytes);
  const long pairs = long(p.batch) * p.hq, gqa = std::max(1, p.hq / p.hkv);
  const long one_wave = p.causal ? pairs : std::max(1, ctas / std::max(1, q_blocks));
  return int(std::clamp<long>(std::min(kv_heads * gqa, one_wave), 1, pairs));
}

// Three consumers (192-row query blocks) pay off at D=64 (session 9 on the H200, same-call A/B against two: full
// 0.89-0.98, causal n=16384 0.91-0.98). Under causal masks over <= 4096 keys they lost (1.06-1.12) until a
// sequence's blocks aligned to its end (attn_prefill::task: the ragged block is its shortest) and the softmax's fast
// path took ~7% off three consumers' tiles and nothing off two's (session 29, same-call A/B, two rounds: causal
// n=1024 / 4096 / 16384 0.964 / 1.009 / 1.005, full 0.988-0.998), so D=64 has no two-consumer kernel. At D=128
// (serial, 160 registers) two overlapped consumers stay the better kernel over <= 1024 keys: there causal three
// lost 1.005 (session 28), and a 1024-token sequence leaves one 192-row block a third full, which the serial order
// runs with one consumer alone (session 25: b64 n=1024 full 0.968 on two). Past 1024 keys, claimed tasks
// (attn_prefill::dynamic) turn causal n=4096 around: 0.96 of two strided consumers' time (session 10).
inline bool three_consumers(const tk::attn_varlen_problem& p) { return p.head_dim != 128 || p.max_seqlen_k > 1024; }

template <typename T, int D, int C, bool Claims = false, bool FastSerial = false, bool Capped = true>
void run(const tk::attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  using K = attn_prefill<T, D, C, Claims, FastSerial, Capped>;
  auto ptr = [](const void* x) { return static_cast<T*>(const_cast<void*>(x)); };
  const bool paged = p.block_table != nullptr;
  typename K::globals g{};
  g.q = {ptr(p.q), {1, p.hq, p.total_q, D}, {0, p.q_head_stride, p.q_token_stride, 1}};
  g.o = {ptr(p.o), {1, p.hq, p.total_q, D}, {0, p.o_head_stride, p.o_token_stride, 1}};
  if (paged) {
    g.k_pages = {ptr(p.k), {p.num_blocks, p.hkv, p.block_size, D}, {p.k_strides[0], p.k_strides[2], p.k_strides[1], 1}};
    g.v_pages = {ptr(p.v), {p.num_blocks, p.hkv, p.block_size, D}, {p.v_strides[0], p.v_strides[2], p.v_strides[1], 1}};
  } else {
    g.k = {ptr(p.k), {1, p.hkv, p.total_k, D}, {0, p.k_strides[1], p.k_strides[0], 1}};
    g.v = {ptr(p.v), {1, p.hkv, p.total_k, D}, {0, p.v_strides[1], p.v_strides[0], 1}};
  }
  g.lse = p.lse;
  g.lse_stride = p.lse_stride;
  g.cu_q = p.cu_seqlens_q;
  g.cu_k = p.cu_seqlens_k;
  g.seqused_k = p.seqused_k;
  g.block_table = p.block_table;
  g.bt_stride = p.bt_stride;
  g.batch = p.batch;
  g.hq = p.hq;
  g.group = p.hq / p.hkv;
  g.q_blocks = ceil_div(p.max_seqlen_q, K::BQ);
  g.paged = paged;
  g.causal = p.causal;
  g.window_left = p.window_left;
  g.window_right = p.window_right;
  g.scale_log2 = p.softmax_scale * LOG2E;
  g.softcap = p.softcap;
  const long tasks = long(g.q_blocks) * p.batch * p.hq;
  const int ctas = int(std::min<long>(tasks, num_sms));
  g.heads_per_group = heads_per_l2_group(p, D, g.q_blocks, ctas);
  const int pairs = p.batch * p.hq, last_group_heads = pairs - (pairs - 1) / g.heads_per_group * g.heads_per_group;
  g.ctas_div = divisor(ctas);
  g.per_group_div = divisor(g.heads_per_group * g.q_blocks);
  g.group_heads_div = divisor(g.heads_per_group);
  g.last_group_heads_div = divisor(last_group_heads);
  g.hq_div = divisor(p.hq);
  g.group_div = divisor(g.group);
  g.block_size = p.block_size;
  g.block_size_div = divisor(paged ? p.block_size : 1);
  if constexpr (Claims) {
    g.task_counter = p.task_counter;
    TK_CUDA_CHECK(cudaMemsetAsync(p.task_counter, 0, sizeof(int), stream));
  }
  lcsf::launch<K>(g, ctas, stream);
}

// The serial kernel's fast softmax (attn_prefill::fast_softmax) under causal masks only. Same-call A/B (session 29,
// two rounds): causal n=4096 / 16384 0.929 / 0.955 (claimed tasks), gqa 0.949, varlen 0.952, paged 0.964 / 0.966;
// but full masks n=4096 / 16384 1.038 / 1.039, so those keep the exact step (its own instantiation).
template <typename T>
void run_serial(const tk::attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  if (tk::attn_varlen_claims(p)) return run<T, 128, 3, true, true>(p, num_sms, stream);
  if (p.causal) return run<T, 128, 3, false, true>(p, num_sms, stream);
  run<T, 128, 3>(p, num_sms, stream);
}

template <typename T>
void run_dtype(const tk::attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:  // the kernel without a softcap's code unless one is asked for (attn_prefill::seeded_first)
      if (p.softcap > 0.f) return run<T, 64, 3>(p, num_sms, stream);
      return run<T, 64, 3, false, false, /*Capped=*/false>(p, num_sms, stream);
    case 128: return three_consumers(p) ? run_serial<T>(p, num_sms, stream) : run<T, 128, 2>(p, num_sms, stream);
    case 256:
      return tk::attn_varlen_claims(p) ? run<T, 256, 2, true>(p, num_sms, stream) : run<T, 256, 2>(p, num_sms, stream);
  }
}

}  // namespace

namespace tk {

// Claimed tasks (attn_prefill::Claims): causal masks at D=256, and over dense K/V at D=128 with three consumers.
// (D=64 causal with claimed tasks, session 29: n=4096 0.915 of the plain stride's time, but 1.07 of the zigzag
// stride's (attn_prefill::task), n=1024 / 16384 1.096 / 1.033; the claiming D=64 consumers spill 252 bytes, and
// 144 with a 56-register producer, which made them 1.26-1.37x slower. Claimed by the producer alone and fed to the
// consumers (lcsf's fed tasks), session 33: its atomic made ptxas spill 190-360 bytes, producer and consumers.)
bool attn_varlen_claims(const attn_varlen_problem& p) {
  if (!p.causal) return false;
  return p.head_dim == 256 || (p.head_dim == 128 && three_consumers(p) && p.block_table == nullptr);
}

void attn_varlen(const attn_varlen_problem& p, int num_sms, cudaStream_t stream) {
  if (p.max_seqlen_q <= 0 || p.batch <= 0) return;
  if (p.type == dtype::bf16) run_dtype<bf16>(p, num_sms, stream);
  else run_dtype<half>(p, num_sms, stream);
}

}  // namespace tk
