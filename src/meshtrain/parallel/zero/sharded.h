// ZeRO data parallelism (stages 1, 2, 3) over the flat parameters of
// flat_param.h, driven by the model's unit hooks.
//
// Per rank and flat parameter (shard = padded / dp elements):
//   stage 1: full compute params [padded] and full f32 grads [padded] resident;
//            master, exp_avg, exp_avg_sq shards. On the step's last
//            micro-batch each unit's grads are reduce-scattered (avg) as soon
//            as after(u, backward) fires, overlapping the rest of backward.
//   stage 2: + the f32 grad shard instead of full grads: every micro-batch's
//            unit grads live in a transient full buffer from before(u, bwd)
//            until the limiter retires their reduce-scatter
//            (max_inflight_reduces), and are ADDED to the shard.
//   stage 3: + compute params sharded: before(u, pass) all-gathers unit u
//            (prefetch: unit u's successor is issued on the communication
//            thread at once), after(u, fwd) frees it unless
//            reshard_after_forward is false (never the head, which backward
//            needs next), after(u, bwd) frees it.
// QLoRA's packed NF4 flats (flat_param.h) are frozen flats of i32 words: whole
// on every rank at stages 1/2, sharded and gathered with their unit at stage 3
// (Parameter::nf4 bound while gathered); loads reach them through the model's
// nf4_writer (write_packed).
// Master shards: a f32 flat parameter's master shard IS its slice of the full
// compute buffer (stages 1/2) or its compute shard (stage 3): in f32 the
// values the model computes with are the master values. bf16 / f16 flat parameters
// keep a separate f32 master shard. Optimizer state (exp_avg, exp_avg_sq and
// the separate master shards) lives in an OffloadStore: resident with tier
// none, streamed through the RAM budget with cpu/disk, with identical results.
//
// Stage 3 with tier cpu/disk: the parameter shards live in the store too (per
// piece: a f32 flat's master chunk, which is its compute values; a 2-byte
// flat's f32 master and its compute chunk in the compute dtype). A gather
// streams the shard into the rank's place in the gathered buffer and gathers
// in place: no parameter shard stays resident. The gathers of a step form one
// store pass whose order is the previous step's recorded gather order (the
// first step's: the model's unit order, forward then backward's re-gathers);
// a gather out of that order starts a new pass from it (correct, less read
// ahead). The update streams each piece's states and values in one pass. A
// budget below one piece of the update is refused at construction.
//
// The step: grad_norm() (sum of squares of the grad shards, all-reduced) ->
// step(lr, clip) (AdamW per (parameter ∩ shard) segment with that
// parameter's decay role; stages 1/2 then all-gather the updated compute
// values in place, waited for by the next before(u, pass)).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/layout/shard_map.h"
#include "meshtrain/parallel/zero/flat_param.h"
#include "meshtrain/parallel/zero/offload.h"

namespace meshtrain::zero {

struct ZeroOptions {
  int stage = 1;  // 1, 2 or 3
  bool prefetch = true;                // stage 3: gather the next unit ahead
  bool reshard_after_forward = true;   // stage 3: free a unit after its forward
  // The store's tier (optimizer state; at stage 3 the parameter shards too).
  // resident_category is ignored: the store's buffers count as optimizer.
  OffloadOptions offload;
  // The store's state (optimizer state; stage 3 offloaded: parameter shards)
  // moves in pieces of at most this many elements per state (the same for
  // every tier, so the tier cannot change a result).
  int64_t piece_elems = int64_t{1} << 20;  // 4 MiB chunks (docs/benchmarks.md: offload store)
  // > 0: the model is a pipeline stage whose schedule interleaves this many
  // micro-batches (begin_micro_batch(true, _) once per step, before it). Each
  // unit's gradients are reduced once, after its last backward of the step
  // (stage 2 keeps the unit's full gradients until then); stage 3 keeps a
  // unit gathered from its first use in the step until then. A tied
  // embedding copy (a stage's embed unit) waits for finish_gradient_sync: the
  // caller sums its gradient over the stages first.
  int64_t pipeline_micro_batches = 0;
  // The rate limiter of the gradient reduce-scatters: at most this many
  // (one per flat parameter; their gradient buffers and receive shards) are
  // in flight; issuing one more first waits for the oldest and frees its
  // buffers. A completed call's buffers are freed only then (or by
  // finish_gradient_sync / quiesce), never when a poll happens to see it
  // done, so the gradient peak does not depend on timing
  // (train/memory_plan.cpp predicts it to the byte). >= 1.
  int64_t max_inflight_reduces = 2;
};

// One stage-3 all-gather as the model met it.
struct GatherEvent {
  size_t unit = 0;
  UnitPass pass = UnitPass::forward;
  CommClock::time_point needed;  // before(unit, pass) was called
  CallRecord call;               // submitted / started / finished
};

// The last step's communication.
struct ZeroStepTiming {
  // CommTimeline over the collectives that completed in the step: wall time
  // in flight, and the part of it the training thread waited for (never more).
  CommTimeline timeline;
  double comm_seconds = 0;
  double exposed_seconds = 0;
  // Bytes of the collectives issued in the step (as CallRecord counts them:
  // reduce_scatter its input, all_gather its output), stages 1/2 including the
  // update's all-gather (waited for in the next forward).
  uint64_t bytes = 0;
  std::vector<GatherEvent> gathers;  // stage 3
  // The offload store in the step (from begin_micro_batch(true, _) to the end of step()):
  // bytes moved, and how many acquires found their chunk read ahead.
  OffloadStats offload;
};

// ZeRO's narrowing of a model's map (params_shard_map / Model::shard_map,
// its parameters at `param_offsets`) for dp rank `rank`: each piece cut to the
// rank's shards; local offsets in the shard space (the flats' shards back to
// back, in flat order, padding included).
layout::ShardMap narrow_to_shard(const ZeroLayout& layout, const std::vector<int64_t>& param_offsets,
                                 const layout::ShardMap& model_map, int rank);

class ShardedDataParallel : public layout::StateAccess {
 public:
  // `model` must use ParamStorage::external; model and dp must outlive this.
  // Installs the model's unit hooks and binds the stage 1/2 buffers.
  // experts: under expert parallelism, the expert-data-parallel group (a
  // split of dp, comm/mesh.h) that the routed experts' flats are sharded and
  // their gradients averaged over (the model has scaled them by 1 / ep,
  // expert_parallel.h); null: every parameter over dp.
  ShardedDataParallel(Model& model, Communicator& dp, const AdamWConfig& adamw,
                      const ZeroOptions& options, Communicator* experts = nullptr);
  ~ShardedDataParallel() override;  // waits for pending calls, removes the hooks
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  const ZeroLayout& layout() const { return layout_; }
  const ZeroOptions& options() const { return options_; }
  Communicator& dp() { return dp_; }
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t step) { step_count_ = step; }

  // Layout-independent initial weights: the values Model::init_weights(seed) gives.
  void init_weights(uint64_t seed);

  // Call before each micro-batch; first: the step's first (zeroes the
  // gradients), last: its final one.
  void begin_micro_batch(bool first, bool last);
  // After the last micro-batch: waits until every gradient shard is complete.
  void finish_gradient_sync();
  // sqrt of the sum of squares of all gradients (collective). stages: the
  // pipeline's pp group, summed over too (a tied copy counted once).
  double grad_norm(Communicator* stages = nullptr);
  // This rank's gradient shards (after finish_gradient_sync), one per flat
  // parameter: what its norm and its update read.
  std::vector<std::span<float>> grad_shards();
  // AdamW on this rank's shards with every gradient multiplied by grad_scale.
  void step(float lr, float grad_scale);
  // Waits for every pending call and frees gathered stage-3 units (after an
  // evaluation; before reading weights).
  void quiesce();
  const ZeroStepTiming& last_step() const { return timing_; }
  // Stage 3 with offload cpu/disk: the parameter shards live in the store.
  bool params_offloaded() const { return params_in_store_; }
  OffloadStats offload_stats() const { return store_->stats(); }

  // The layout narrowing of ZeRO: the model's map (Model::shard_map) cut to
  // this rank's shards. Local offsets are in the shard space: the flat
  // parameters' shards back to back, in flat order (padding included).
  layout::ShardMap shard_map(const layout::ShardMap& model_map) const;  // narrow_to_shard
  // The shard space of every state (offloaded state streams through the store).
  void read(layout::StateKind kind, int64_t offset, int64_t count, float* out) override;
  void write(layout::StateKind kind, int64_t offset, int64_t count, const float* in) override;
  // After writing master values: stages 1/2 all-gather the compute values (collective).
  void finish_load();
  // One f32 parameter (registry index; no compute copy) whole on every rank,
  // and an update of it by the same `delta` on every rank, between steps
  // (the MoE selection bias): stages 1/2 hold it whole (bound); at stage 3
  // each rank reads and updates its shard's segments, and the read sums them
  // over the flat's group (collective).
  std::vector<float> parameter_values(size_t param);
  void add_to_parameter(size_t param, std::span<const float> delta);

  // Checkpoints: whole tensors in the flat model layout (parameter i at
  // params()[i].offset, num_params() elements). gather: collective, only
  // `root` receives (the others pass nullptr). load: every rank passes all.
  using State = layout::StateKind;
  void gather_full(State state, int root, float* full);
  void load_full(State state, const float* full);

 private:
  struct Piece;
  struct Flat;
  struct Reduce;

  // Flat `flat`'s group (dp, or the experts'), and this rank's rank in it.
  Communicator& group(size_t flat);
  int group_rank(size_t flat) const { return layout_.group_rank(flat, rank_); }
  void before(size_t unit, UnitPass pass);
  void after(size_t unit, UnitPass pass);
  void gather_async(size_t flat);    // stage 3: allocate full, issue its all-gather
  void wait_gather(size_t flat);     // any stage: wait for a pending all-gather
  void release_params(size_t flat);  // stage 3
  void reduce_scatter_grads(size_t flat);
  void finish_reduces();  // waits for every pending reduce-scatter, in issue order
  void finish_oldest_reduce();
  void bind_values(size_t flat);
  void bind_grads(size_t flat, bool bound);
  // Stages 1/2, after the update (trainable flats) or a load / init (all).
  void all_gather_updated(bool frozen_too);
  // Waits for a call, adds it to timing_'s timeline, resets it.
  void finish(Work& work);
  float* grad_shard(size_t flat);
  Tensor compute_values(size_t flat);  // this rank's shard of the compute values (a view)
  // A state's [shard] values (master writes also update the compute values).
  void read_state(size_t flat, State state, int64_t begin, int64_t end, float* out);
  void write_state(size_t flat, State state, int64_t begin, int64_t end, const float* in);
  // Each flat parameter's first element in the shard space, and (last) its size.
  std::vector<int64_t> shard_bases() const;
  // fn(flat, begin, end, done) for the shard pieces of [offset, offset + count).
  void access_shard_space(int64_t offset, int64_t count,
                          const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) const;
  size_t prefetch_target(size_t unit, UnitPass pass) const;
  void check_offload_budget(const std::vector<OffloadChunkSpec>& chunks) const;
  // Parameters in the store: the stage-3 gathers' read-ahead (a store pass).
  std::vector<size_t> predicted_param_schedule() const;
  // The model's nf4_writer: this rank's words of NF4 weight `param`'s packed bytes.
  void write_packed(size_t param, std::span<const uint8_t> packed);
  void stream_in_params(size_t flat, const Tensor& dst);  // the shard into its gathered place
  void announce_params(size_t flat);
  void end_param_pass();

  Model& model_;
  Communicator& dp_;
  Communicator* experts_;
  AdamWConfig adamw_;
  ZeroOptions options_;
  ZeroLayout layout_;
  int rank_ = 0;
  std::vector<Flat> flats_;
  std::vector<Reduce> reduces_;  // in issue order
  std::unique_ptr<OffloadStore> store_;
  bool params_in_store_ = false;
  std::vector<size_t> param_schedule_;  // flats in gather order over a step
  size_t param_pass_next_ = 0;          // position in param_schedule_ of the next gather
  std::vector<size_t> recorded_;        // this step's gathers, the next step's schedule
  bool recording_ = false;
  OffloadStats step_store_stats_;
  int64_t step_count_ = 0;
  bool last_micro_batch_ = false;
  std::vector<int64_t> backwards_;  // pipeline: each unit's backwards in this step
  std::vector<bool> deferred_;      // pipeline: units reduced in finish_gradient_sync
  ZeroStepTiming timing_;
};

}  // namespace meshtrain::zero
