// Attention prefill (varlen, causal, sliding window, softcap, GQA, paged K/V) as an lcsf kernel: a task is
// (sequence, query head, 128- or 192-row query block), tasks run longest-first on a persistent grid. The producer
// warpgroup streams K and V tiles through a TMA ring (prefill_producer); each consumer warpgroup owns 64 query rows
// (prefill_consumer); prefill_epilogue writes the output. policy.cuh says which variant does what.
#pragma once
#include "consumer.cuh"
#include "epilogue.cuh"
#include "layout.cuh"
#include "producer.cuh"
#include "scheduler.cuh"

namespace tk::prefill {

template <typename T, policy P>
struct attn_prefill : prefill_layout<T, P> {
  using L = prefill_layout<T, P>;
  using S = prefill_scheduler<L>;
  using Load = prefill_producer<L>;
  using C = prefill_consumer<L>;
  using E = prefill_epilogue<L>;
  using typename L::globals, typename L::task_t, typename L::input_block, typename L::scratch_block,
      typename L::consumer_state;

  // lcsf's hooks (lcsf.cuh), each the role's.
  __device__ static int task_count(const globals& g) { return S::task_count(g); }
  __device__ static task_t task(const globals& g, int id, int rank) { return S::task(g, id, rank); }
  __device__ static int own_iters(const globals& g, const task_t& t, int wg)
    requires(P.trims)
  {
    return S::own_iters(g, t, wg);
  }
  __device__ static void load(input_block& in, const globals& g, const task_t& t, int it, semaphore& full) {
    Load::load(in, g, t, it, full);
  }
  __device__ static void load_task_inputs(scratch_block& scratch, const globals& g, const task_t& t)
    requires(P.queries_ahead)
  {
    Load::load_task_inputs(scratch, g, t);
  }
  __device__ static void init_scratch(scratch_block& s) { C::init_scratch(s); }
  __device__ static void init_state(consumer_state& s, int wg) { C::init_state(s, wg); }
  __device__ static void compute_first(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                       const task_t& t, int wg) {
    C::compute_first(s, in, scratch, g, t, wg);
  }
  __device__ static void compute(consumer_state& s, input_block& in, scratch_block& scratch, const globals& g,
                                 const task_t& t, int it, int wg) {
    C::compute(s, in, scratch, g, t, it, wg);
  }
  __device__ static void sit_out(int wg)
    requires(P.trims)
  {
    C::sit_out(wg);
  }
  __device__ static void drain(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t, int wg) {
    C::drain(s, scratch, g, t, wg);
  }
  __device__ static void finish(consumer_state& s, scratch_block& scratch, const globals& g, const task_t& t, int wg) {
    E::finish(s, scratch, g, t, wg);
  }
};

}  // namespace tk::prefill
