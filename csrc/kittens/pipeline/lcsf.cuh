// The load-compute-store-finish template: a persistent, warp-specialised kernel skeleton.
//
// One producer warpgroup streams inputs into an N-stage shared-memory ring with TMA; 1..3 consumer
// warpgroups compute on each stage and hand it back; after a task's last stage each consumer runs
// `finish` (the epilogue) while the producer is already loading the next task. The template owns the
// semaphores, phase bits, ring indices, shared-memory carving, register budgets and the task loop; a
// kernel states its layouts and its steps:
//
//   struct my_kernel {
//     static constexpr int consumers, stages;
//     static constexpr lcsf::options pipeline{...};                // optional: see `options` below
//     struct globals; struct input_block; struct scratch_block; struct consumer_state; struct task_t;  // task_t: int iters
//     static int task_count(const globals&);                       // tasks in the work list
//     static task_t task(const globals&, int id, int rank);        // id -> work item (tile order lives here)
//     static void load(input_block&, const globals&, const task_t&, int iter, semaphore& full);  // 1 thread
//     static void compute(consumer_state&, input_block&, scratch_block&, const globals&, const task_t&, int iter,
//                         int consumer);
//     static void finish(consumer_state&, scratch_block&, const globals&, const task_t&, int consumer);
//   };
//
// Optional hooks (the template calls them when the kernel has them):
//   task_range(g, cta, ctas) -> int2         this CTA runs tasks [x, y) in order (a precomputed, balanced split)
//   next_task(g, t, id) -> int               the task after `id` in that range (a work list that skips empty slots)
//   compute_first(s, in, scratch, g, t, c)   a task's first stage (else compute(..., 0, ...))
//   drain(s, scratch, g, t, c)               after a task's last compute, its last stage still held (a kernel
//                                            that issues a stage's last product one step late)
//   init_scratch(scratch)                    one thread, before the block starts (e.g. semaphores)
//   init_state(s, c)                         once a consumer; finish leaves the state ready for the next task
//   load_task_inputs(scratch, g, t)          the producer, once a task has sent for its first stage: inputs read
//                                            throughout a task, kept in scratch (the kernel hands them back itself)
//   own_iters(g, t, c) -> int, sit_out(c)    the consumer computes only the task's first own_iters stages (drain
//                                            after the last) and sits out the rest: waits for each, sit_out, frees it
//   converted_stages, converted_block,       a second ring between the producer and the consumers: the producer
//   convert_stage(dst, src, g, t, it, th)    warpgroup's other three warps turn each landed stage into a
//                                            converted_block (e.g. FP8 tiles into fp16), free the raw stage, and the
//                                            consumers compute on the converted one (compute's input_block& is then
//                                            a converted_block&). Strided walks, no clusters, no staggered pairs.
//   reads_raw_stage = true                   with a converted ring, the consumers read the raw stage too: compute
//                                            gets a both_stages& {raw, converted}; a raw stage is freed once the
//                                            converting warps and the consumers (right after that stage's compute,
//                                            which waits for its products of it) are done with it
//   defers_converted = true                  (with reads_raw_stage) compute j reads the converted stage j only at
//                                            step j + 1 or in drain (e.g. V_j for the next step's P V): the consumer
//                                            waits for it there, not before compute j, so a step waits on its raw
//                                            stage alone and the converting warps may finish a tile later
// compute may leave its wgmma groups in flight: the template retires them `release_lag` stages late and only then
// frees the stage.
#pragma once
#include <cuda_runtime.h>
#include "../core/errors.cuh"
#include "../ops/group.cuh"
#include "../ops/semaphore.cuh"
#include "../ops/cluster.cuh"
#include "../ops/tma.cuh"
#include "chain.cuh"

namespace kittens::lcsf {

template <typename K>
concept kernel_policy = requires {
  typename K::globals;
  typename K::input_block;
  typename K::scratch_block;
  typename K::consumer_state;
  typename K::task_t;
  requires K::consumers >= 1 && K::consumers <= 3;
  requires K::stages >= 1;
};

template <kernel_policy K> constexpr int threads = (K::consumers + 1) * WARPGROUP_THREADS;
// How a CTA finds its tasks.
enum class task_walk {
  strided,     // every ctas-th task from the CTA's index (or task_range's), each consumer decoding it with task()
  prefetched,  // strided, and each consumer reads task(next) before it runs the current one, so the next task's
               // metadata loads are in flight during this one's work
  fed,         // strided, and the producer decodes each task once and hands it to the consumers through shared
               // memory (a ring of FEED): no consumer warp waits on the task's metadata loads
  claimed,     // each CTA starts on task `cta` and claims the next (ctas + an atomic count on globals::task_counter,
               // zero at launch) whenever its producer can start loading it: tasks of unequal length balance
               // themselves. No clusters. (No runtime switch back to the stride: a launcher instantiates both.)
};
// How a step's inputs sit in the ring.
enum class ring_layout {
  single,           // one ring slot a step
  // Two slots a step, A_j then B_j (t.iters counts slots; load gets the slot's index); step j uses A_j and the
  // previous step's B_{j-1} (attention: K_j for S_j, V_{j-1} for the previous P V). A_j goes back a step before
  // B_j, so the producer refills it while B_j is still held. compute, compute_first and drain get the step index;
  // A_j's slot is even, B_j the next one, `(&in)[1]`; drain runs once the last B has arrived. Release lag 1, an
  // even number of stages.
  staggered_pairs,
};
// How a launch relates to the stream's kernels before and after it (chain.cuh).
enum class launch_chain {
  none,
  // Launched chained to the previous kernel: the CTAs set up their semaphores while it finishes and wait for it
  // before their first global access. They do not allow the next kernel early (a merge of their partials would land
  // crowded on the few SMs this grid leaves free).
  chained,
  // chained, and each producer allows the next kernel once it has sent for its last task's inputs, so the next GEMM
  // of a stream of them sets up while this one's consumers still multiply and store (one CTA an SM).
  chained_early_next,
};
struct options {
  int release_lag = 1;  // stages a consumer keeps its products in flight before freeing a stage (0: frees at once)
  ring_layout ring = ring_layout::single;
  task_walk walk = task_walk::strided;
  launch_chain chain = launch_chain::none;
  // CTAs that walk the work list together (task ids count clusters, task(id, rank) maps to each CTA's own item);
  // a stage is reloaded only once every CTA of the cluster has freed it, so loads may multicast into all of them.
  int cluster = 1;
};
template <typename K> consteval options options_of() {
  if constexpr (requires { K::pipeline; }) return K::pipeline;
  else return {};
}
template <typename K> consteval int cluster_size() { return options_of<K>().cluster; }
template <typename K> consteval int release_lag() { return options_of<K>().release_lag; }
template <typename K> consteval bool staggered_pairs() { return options_of<K>().ring == ring_layout::staggered_pairs; }
template <typename K> consteval bool chained() { return options_of<K>().chain != launch_chain::none; }
template <typename K> consteval bool early_next() { return options_of<K>().chain == launch_chain::chained_early_next; }
template <typename K> consteval bool dynamic_tasks() { return options_of<K>().walk == task_walk::claimed; }
template <typename K> consteval bool fed_tasks() { return options_of<K>().walk == task_walk::fed; }
template <typename K> consteval bool prefetch_tasks() { return options_of<K>().walk == task_walk::prefetched; }
template <typename K> consteval int converted_stages() {
  if constexpr (requires { K::converted_stages; }) return K::converted_stages;
  else return 0;
}
template <typename K> consteval bool converts() { return converted_stages<K>() > 0; }
template <typename K> consteval bool reads_raw_stage() {
  if constexpr (requires { K::reads_raw_stage; }) return converts<K>() && K::reads_raw_stage;
  else return false;
}
template <typename K> consteval bool defers_converted() {
  if constexpr (requires { K::defers_converted; }) return reads_raw_stage<K>() && K::defers_converted;
  else return false;
}
// What compute reads with reads_raw_stage: the raw stage (e.g. e4m3 K for an e4m3 product) and the converted one.
template <typename Raw, typename Converted> struct both_stages {
  const Raw& raw;
  Converted& converted;
};
// The block compute reads: the consumers' ring stage, or both_stages (named only where the kernel reads both).
template <typename K, typename Ring, bool = reads_raw_stage<K>()> struct compute_input { using type = Ring; };
template <typename K, typename Ring> struct compute_input<K, Ring, true> {
  using type = both_stages<typename K::input_block, typename K::converted_block>;
};
// The warps that convert (converts<K>): the producer warpgroup's warps 1-3, beside the one thread that loads.
inline constexpr int CONVERTER_WARPS = WARPGROUP_WARPS - 1;
inline constexpr int CONVERTER_THREADS = CONVERTER_WARPS * WARP_THREADS;
inline constexpr int FEED = 8;  // fed tasks in flight
// A warp's copy of a shared-memory object as lane 0 reads it, in registers the compiler knows are warp-uniform.
template <typename T> __device__ __forceinline__ T warp_uniform_copy(const T& src) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % 4 == 0);
  int w[sizeof(T) / 4];
  memcpy(w, &src, sizeof(T));
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 4); i++) w[i] = __shfl_sync(0xffffffffu, w[i], 0);
  T out;
  memcpy(&out, w, sizeof(T));
  return out;
}
// The task after `id` in a CTA's walk: K::next_task where the policy has one (its work list skips), else id + step.
template <typename K>
__device__ __forceinline__ int next_id(const typename K::globals& g, const typename K::task_t& t, int id, int step) {
  if constexpr (requires { K::next_task(g, t, id); }) return K::next_task(g, t, id);
  else return id + step;
}
// The producer's registers: 40 beside two consumers; beside three, 32 (3 x 160 + 32 fill the file exactly, so
// the consumers keep 160; 24 made the paged loads' page lookups spill). Converting warps keep a stage's units in
// flight: 96 beside one consumer (which keeps 240; 64 spilled at D=256).
// A kernel may ask for more (K::min_producer_registers) where its producer holds more in flight; beside one
// consumer the file has room (the consumer keeps 240 either way).
template <kernel_policy K> constexpr int min_producer_registers() {
  if constexpr (requires { K::min_producer_registers; }) return K::min_producer_registers;
  else return 0;
}
template <kernel_policy K>
constexpr int producer_registers =
    std::max(K::consumers == 3 ? 32 : converts<K>() ? 96 : 40, min_producer_registers<K>());
// What is left of the 64K-register file, split over the consumers (at most 240 a thread).
template <kernel_policy K> constexpr int consumer_registers =
    std::min(240, ((65536 / WARPGROUP_THREADS - producer_registers<K>) / K::consumers) / 8 * 8);

template <kernel_policy K, bool = converts<K>()> struct alignas(1024) shared_layout {
  typename K::input_block ring[K::stages];
  typename K::scratch_block scratch;
};
// With a converted ring: its stages (1024-aligned like the ring's) and its semaphores.
template <kernel_policy K> struct alignas(1024) shared_layout<K, true> {
  typename K::input_block ring[K::stages];
  typename K::converted_block converted[converted_stages<K>()];
  typename K::scratch_block scratch;
  semaphore converted_full[converted_stages<K>()], converted_empty[converted_stages<K>()];
};
template <kernel_policy K> constexpr size_t shared_bytes = sizeof(shared_layout<K>) + 1024;  // + alignment slack

template <kernel_policy K>
__global__ void __launch_bounds__(threads<K>, 1) kernel(const __grid_constant__ typename K::globals g) {
  static_assert(producer_registers<K> + K::consumers * consumer_registers<K> <= 65536 / WARPGROUP_THREADS,
                "the producer's and the consumers' registers pass the register file");
  extern __shared__ uint8_t smem_raw[];
  // Aligned by an offset from smem_raw itself, not by masking a cast integer: the pointer keeps its shared
  // address space, so the kernels' plain C++ accesses to their scratch compile to LDS/STS, not generic LD/ST.
  const uint32_t misalign = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u;
  auto& smem = *reinterpret_cast<shared_layout<K>*>(smem_raw + ((1024u - misalign) & 1023u));
  __shared__ semaphore full[K::stages], empty[K::stages];
  // Claimed tasks: the producer's claimed ids on their way to the consumers (a ring of 2).
  __shared__ int feed_id[2];
  __shared__ semaphore feed_full[2], feed_empty[2];
  // Fed tasks: the tasks on their way to the consumers.
  constexpr int fed = fed_tasks<K>() ? FEED : 1;
  __shared__ typename K::task_t feed_task[fed];
  __shared__ semaphore task_full[fed], task_empty[fed];

  constexpr int cluster = cluster_size<K>();
  static_assert(!dynamic_tasks<K>() || cluster == 1, "dynamic tasks are claimed per CTA: no clusters");
  static_assert(!staggered_pairs<K>() || (K::stages % 2 == 0 && release_lag<K>() == 1),
                "staggered pairs: an even number of stages (A in even slots), release lag 1");
  static_assert(!converts<K>() || (cluster == 1 && !staggered_pairs<K>() && !dynamic_tasks<K>() && !fed_tasks<K>() &&
                                   !prefetch_tasks<K>()),
                "a converted ring: strided walks on single CTAs, one slot a step");
  static_assert(!defers_converted<K>() || release_lag<K>() == 1,
                "defers_converted: release lag 1 (a converted stage is freed a step after its deferred wait)");
  // The consumers' ring: the converted one where there is one, else the ring itself.
  constexpr int cstages = converts<K>() ? converted_stages<K>() : K::stages;
  semaphore *cfull = full, *cempty = empty;
  auto* cring = [&] {
    if constexpr (converts<K>()) return smem.converted;
    else return smem.ring;
  }();
  if constexpr (converts<K>()) cfull = smem.converted_full, cempty = smem.converted_empty;
  if (threadIdx.x == 0) {
    for (int s = 0; s < K::stages; s++) {
      init_semaphore(full[s], 1);  // the producer's expect_bytes
      // every consumer warp of the cluster, or every converting warp (and every consumer warp: reads_raw_stage)
      init_semaphore(empty[s], converts<K>() ? CONVERTER_WARPS + (reads_raw_stage<K>() ? K::consumers * WARPGROUP_WARPS : 0)
                                             : cluster * K::consumers * WARPGROUP_WARPS);
    }
    if constexpr (converts<K>())
      for (int s = 0; s < cstages; s++)
        init_semaphore(cfull[s], CONVERTER_WARPS), init_semaphore(cempty[s], K::consumers * WARPGROUP_WARPS);
    if constexpr (dynamic_tasks<K>())
      for (int s = 0; s < 2; s++) init_semaphore(feed_full[s], 1), init_semaphore(feed_empty[s], K::consumers * WARPGROUP_WARPS);
    if constexpr (fed_tasks<K>())
      for (int s = 0; s < FEED; s++) init_semaphore(task_full[s], 1), init_semaphore(task_empty[s], K::consumers * WARPGROUP_WARPS);
    if constexpr (requires { K::init_scratch(smem.scratch); }) K::init_scratch(smem.scratch);
    fence_semaphore_init();
  }
  if constexpr (cluster > 1) cluster_sync();
  else __syncthreads();
  if constexpr (chained<K>()) chain::wait();  // the task ranges, inputs and outputs are the previous kernel's till then

  const int rank = cluster > 1 ? cluster_rank() : 0;
  const int cta = cluster > 1 ? cluster_id_x() : int(blockIdx.x);
  const int ctas = cluster > 1 ? cluster_count_x() : int(gridDim.x);
  int first = cta, num_tasks, step = ctas;
  if constexpr (requires { K::task_range(g, cta, ctas); }) {
    const int2 range = K::task_range(g, cta, ctas);
    first = range.x, num_tasks = range.y, step = 1;
  } else {
    num_tasks = K::task_count(g);
  }
  // Broadcast from lane 0: the compiler then knows role is warp-uniform, so what derives from it (a consumer's
  // shared-memory addresses, its wgmma descriptors) stays in uniform registers instead of moving over per use.
  const int role = __shfl_sync(0xffffffffu, warpgroupid(), 0);
  if (role == K::consumers) {  // producer
    warpgroup::decrease_registers<producer_registers<K>>();
    if (warpgroup::thread() == 0) {
      int stage = 0, phase = 0, fslot = 0, fphase = 0;
      auto load_task = [&](int id) {
        const typename K::task_t t = K::task(g, id, rank);
        if constexpr (fed_tasks<K>()) {
          wait(task_empty[fslot], fphase ^ 1);  // a fresh ring passes at once
          feed_task[fslot] = t;
          arrive(task_full[fslot]);
          if (++fslot == FEED) fslot = 0, fphase ^= 1;
        }
        for (int it = 0; it < t.iters; it++) {
          wait(empty[stage], phase ^ 1);  // a fresh ring passes at once
          K::load(smem.ring[stage], g, t, it, full[stage]);
          if (++stage == K::stages) stage = 0, phase ^= 1;
          if constexpr (requires { K::load_task_inputs(smem.scratch, g, t); })
            if (it == 0) K::load_task_inputs(smem.scratch, g, t);  // after the first stage's loads
        }
        return t;
      };
      if constexpr (dynamic_tasks<K>()) {
        int slot = 0, feed_phase = 0;
        for (int id = first;; id = ctas + atomicAdd(g.task_counter, 1)) {
          wait(feed_empty[slot], feed_phase ^ 1);
          feed_id[slot] = id;  // id >= num_tasks tells the consumers to stop
          arrive(feed_full[slot]);
          if (++slot == 2) slot = 0, feed_phase ^= 1;
          if (id >= num_tasks) break;
          load_task(id);
        }
      } else {
        for (int id = first; id < num_tasks;) id = next_id<K>(g, load_task(id), id, step);
      }
      if constexpr (early_next<K>()) chain::allow_next();  // every load sent: the next kernel may set up
    } else if constexpr (converts<K>()) {
      if (warpgroup::warp() > 0) {  // warps 1-3 walk the same tasks, converting each landed stage
        const int thread = warpgroup::thread() - WARP_THREADS;
        int stage = 0, phase = 0, cstage = 0, cphase = 0;
        for (int id = first; id < num_tasks;) {
          const typename K::task_t t = K::task(g, id, rank);
          for (int it = 0; it < t.iters; it++) {
            wait(full[stage], phase);
            wait(cempty[cstage], cphase ^ 1);  // a fresh ring passes at once
            K::convert_stage(cring[cstage], smem.ring[stage], g, t, it, thread);  // thread < CONVERTER_THREADS
            fence_async_shared();  // the converted tile, for the consumers' wgmma (async proxy)
            __syncwarp();          // the warp's lanes have read the raw stage and written their part
            if (laneid() == 0) arrive(empty[stage]), arrive(cfull[cstage]);
            if (++stage == K::stages) stage = 0, phase ^= 1;
            if (++cstage == cstages) cstage = 0, cphase ^= 1;
          }
          id = next_id<K>(g, t, id, step);
        }
      }
    }
  } else {  // consumer `role`
    warpgroup::increase_registers<consumer_registers<K>>();
    typename K::consumer_state state;
    if constexpr (requires { K::init_state(state, role); }) K::init_state(state, role);
    int stage = 0, phase = 0;
    [[maybe_unused]] int rstage = 0, rphase = 0;  // reads_raw_stage: the raw ring's position (the consumer ring's is stage / phase)
    auto release = [&](int s) {
      if (laneid() == 0) {
        if constexpr (cluster > 1) {
#pragma unroll
          for (int cta = 0; cta < cluster; cta++) arrive_remote(cempty[s], cta);
        } else {
          arrive(cempty[s]);
        }
      }
    };
    auto step_stage = [&](auto&& compute_it) {
      if constexpr (!defers_converted<K>()) wait(cfull[stage], phase);  // (defers_converted: run_task waits)
      compute_it();
      warpgroup::mma_async_wait<release_lag<K>()>();  // lag 1: the previous stage's products are done with it
    };
    // Staggered pairs: step j waits for A_j (slot `stage`) and B_{j-1} (slot b), frees both after compute.
    auto run_staggered = [&](const typename K::task_t& t) {
      if constexpr (staggered_pairs<K>()) {  // (not compiled for other kernels: their compute takes other blocks)
        const int steps = t.iters / 2;
        int b = 0, b_phase = 0;
        auto advance = [&] {
          b = stage + 1, b_phase = phase;  // B_j, for the next step
          if ((stage += 2) == cstages) stage = 0, phase ^= 1;
        };
        if (steps > 0) {
          wait(cfull[stage], phase);
          if constexpr (requires { K::compute_first(state, cring[stage], smem.scratch, g, t, role); })
            K::compute_first(state, cring[stage], smem.scratch, g, t, role);
          else
            K::compute(state, cring[stage], smem.scratch, g, t, 0, role);
          warpgroup::mma_async_wait<1>();
          release(stage);
          advance();
        }
        for (int j = 1; j < steps; j++) {
          wait(cfull[stage], phase);
          wait(cfull[b], b_phase);
          K::compute(state, cring[stage], smem.scratch, g, t, j, role);
          warpgroup::mma_async_wait<1>();
          release(stage);
          release(b);
          advance();
        }
        if (steps > 0) {
          wait(cfull[b], b_phase);
          if constexpr (requires { K::drain(state, smem.scratch, g, t, role); })
            K::drain(state, smem.scratch, g, t, role);
        }
        warpgroup::mma_async_wait<0>();  // on every path (ptxas injects one before finish otherwise)
        if (steps > 0) release(b);
        K::finish(state, smem.scratch, g, t, role);
      }
    };
    auto run_task = [&](const typename K::task_t& t) {
      if constexpr (staggered_pairs<K>()) {
        run_staggered(t);
        return t;
      }
      // own: the stages this consumer computes, a prefix of the task's (K::own_iters: e.g. its rows see no key past
      // them); it sits the rest out (K::sit_out) and frees each stage.
      int own = t.iters;
      if constexpr (requires { K::own_iters(g, t, role); }) own = K::own_iters(g, t, role);
      int previous = -1, previous_phase = 0;
      // reads_raw_stage: the raw ring's stage of the same step (both rings advance a stage a step), handed to
      // compute beside the converted one and freed right after that compute.
      auto on_stage = [&](auto&& compute_on) {
        if constexpr (reads_raw_stage<K>()) {
          wait(full[rstage], rphase);  // landed (the converting warps saw it): makes TMA's bytes visible here too
          both_stages<typename K::input_block, typename K::converted_block> in{smem.ring[rstage], cring[stage]};
          compute_on(in);
        } else {
          compute_on(cring[stage]);
        }
      };
      auto release_raw = [&] {
        if constexpr (reads_raw_stage<K>()) {
          if (laneid() == 0) arrive(empty[rstage]);
          if (++rstage == K::stages) rstage = 0, rphase ^= 1;
        }
      };
      // What compute reads (checked here, outside on_stage's generic lambda, where nvcc takes a missing member for
      // an error rather than an unmet requirement).
      using compute_in = typename compute_input<K, std::remove_reference_t<decltype(cring[0])>>::type;
      constexpr bool has_compute_first =
          requires(compute_in& in) { K::compute_first(state, in, smem.scratch, g, t, role); };
      // The first stage is peeled off so that the steady-state body has no branch around its wgmma
      // (the compiler cannot tell that `it` is uniform and would serialize the products otherwise).
      if (own > 0) {
        step_stage([&] {
          on_stage([&](auto& in) {
            if constexpr (has_compute_first) K::compute_first(state, in, smem.scratch, g, t, role);
            else K::compute(state, in, smem.scratch, g, t, 0, role);
          });
        });
        release_raw();
        if constexpr (release_lag<K>() == 0) release(stage);
        previous = stage, previous_phase = phase;
        if (++stage == cstages) stage = 0, phase ^= 1;
      }
      for (int it = 1; it < own; it++) {
        if constexpr (defers_converted<K>()) wait(cfull[previous], previous_phase);  // what compute `it` reads of it
        step_stage([&] { on_stage([&](auto& in) { K::compute(state, in, smem.scratch, g, t, it, role); }); });
        release_raw();
        if constexpr (release_lag<K>() == 0) release(stage);
        else release(previous);
        previous = stage, previous_phase = phase;
        if (++stage == cstages) stage = 0, phase ^= 1;
      }
      if constexpr (defers_converted<K>())
        if (previous >= 0) wait(cfull[previous], previous_phase);  // the last converted stage, for drain
      if constexpr (requires { K::drain(state, smem.scratch, g, t, role); })
        if (own > 0) K::drain(state, smem.scratch, g, t, role);
      warpgroup::mma_async_wait<0>();
      if (release_lag<K>() == 1 && previous >= 0) release(previous);
      if constexpr (requires { K::own_iters(g, t, role); }) {
#pragma unroll 1
        for (int it = own; it < t.iters; it++) {
          wait(cfull[stage], phase);
          K::sit_out(role);
          release(stage);
          if constexpr (reads_raw_stage<K>()) {
            wait(full[rstage], rphase);
            release_raw();
          }
          if (++stage == cstages) stage = 0, phase ^= 1;
        }
      }
      K::finish(state, smem.scratch, g, t, role);
      return t;
    };
    if constexpr (dynamic_tasks<K>()) {
      for (int slot = 0, feed_phase = 0;;) {
        wait(feed_full[slot], feed_phase);
        // Lane 0's copy for the whole warp: the compiler then treats the task as warp-uniform (as with the
        // stride order), not as a per-thread value with every address derived from it.
        const int id = __shfl_sync(0xffffffffu, feed_id[slot], 0);  // also: the warp has read the slot
        if (laneid() == 0) arrive(feed_empty[slot]);
        if (++slot == 2) slot = 0, feed_phase ^= 1;
        if (id >= num_tasks) break;
        run_task(K::task(g, id, rank));
      }
    } else if constexpr (fed_tasks<K>()) {
      for (int id = first, fslot = 0, fphase = 0; id < num_tasks;) {
        wait(task_full[fslot], fphase);
        const typename K::task_t t = warp_uniform_copy(feed_task[fslot]);
        // Every lane read the slot: __syncwarp orders those reads before lane 0's arrive hands it back (the shuffle
        // orders no memory). racecheck reports a hazard here, as on the same hand-off in a minimal kernel
        // (test_primitives' test_mbarrier_handoff): the tool does not follow the mbarriers' ordering.
        __syncwarp();
        if (laneid() == 0) arrive(task_empty[fslot]);
        if (++fslot == FEED) fslot = 0, fphase ^= 1;
        id = next_id<K>(g, run_task(t), id, step);
      }
    } else if constexpr (prefetch_tasks<K>()) {
      // The next task is read (its loads of sequence lengths and the like issued) before this one runs, so
      // that their latency passes under this task's work instead of heading the next one's.
      if (first < num_tasks) {
        typename K::task_t t = K::task(g, first, rank);
        for (int id = first;;) {
          const int next = next_id<K>(g, t, id, step);
          const typename K::task_t ahead = K::task(g, next < num_tasks ? next : id, rank);
          run_task(t);
          if (next >= num_tasks) break;
          t = ahead;
          id = next;
        }
      }
    } else {
      for (int id = first; id < num_tasks;) id = next_id<K>(g, run_task(K::task(g, id, rank)), id, step);
    }
    // Shared memory must outlive pending stores. Bulk-store groups belong to the thread that committed them,
    // and kernels issue from one lane of any warp (the GEMM's per-warp epilogue): each warp's lane 0 waits.
    if (laneid() == 0) tma::store_wait<0>();
  }
  // No CTA may leave while a peer can still multicast into it or arrive on its semaphores.
  if constexpr (cluster > 1) cluster_sync();
}

// Launch on `grid` CTAs (normally min(tasks, SMs), rounded down to whole clusters) on `stream`.
template <kernel_policy K>
void launch(const typename K::globals& g, int grid, cudaStream_t stream) {
  // The kernel's own static shared memory (48-64 bytes in ptxas' report) comes out of the same 227 KB.
  static_assert(shared_bytes<K> + 128 <= 227 * 1024, "the input ring and scratch do not fit in 227 KB of shared memory");
  auto* fn = &kernel<K>;
  int device = 0;
  TK_CUDA_CHECK(cudaGetDevice(&device));
  static bool configured[64] = {};  // the shared-memory opt-in is per device
  if (device >= 64 || !configured[device]) {
    // The static_assert allows the kernel 128 static bytes; a kernel whose hooks declare more (e.g. a schedule's
    // scratch) is caught here, by name, rather than as cudaFuncSetAttribute's "invalid argument".
    cudaFuncAttributes attributes{};
    TK_CUDA_CHECK(cudaFuncGetAttributes(&attributes, fn));
    if (attributes.sharedSizeBytes + shared_bytes<K> > 227 * 1024)
      throw std::runtime_error("lcsf kernel: " + std::to_string(attributes.sharedSizeBytes) + " static + " +
                               std::to_string(shared_bytes<K>) + " dynamic bytes of shared memory exceed 227 KB");
    TK_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes<K>)));
    if (device < 64) configured[device] = true;
  }
  constexpr int cluster = cluster_size<K>();
  grid = grid / cluster * cluster;
  if (grid <= 0) return;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads<K>);
  config.dynamicSmemBytes = shared_bytes<K>;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1] = chain::attribute();
  config.attrs = attr;
  config.numAttrs = chained<K>() ? 2 : 1;
  TK_CUDA_CHECK(cudaLaunchKernelEx(&config, fn, g));
}

}  // namespace kittens::lcsf
