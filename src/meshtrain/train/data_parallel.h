// How the data-parallel ranks share gradients and optimizer state: one
// interface for no sharing (dp 1), DDP and ZeRO 1/2/3 (± offload), chosen by
// make_data_parallel from the config and the mesh. The trainer calls it and
// never asks which one it has.
//
// Protocol of a step: begin_step(); then either (local loop) begin_micro_batch
// before each micro-batch's forward/backward, or (pipeline) begin_schedule()
// before and end_schedule() after the schedule; then finish_gradient_sync(),
// grad_norm(), step(). Gradients are then the dp average and the update the
// single-rank one.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/model/model.h"
#include "meshtrain/parallel/layout/shard_map.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  virtual std::string describe() const = 0;  // for the console
  // The dp group the step's loss is summed over; null when there is none.
  virtual Communicator* group() = 0;

  virtual void init_weights(uint64_t seed) = 0;
  virtual void begin_step() = 0;
  virtual void begin_micro_batch(bool first, bool last) = 0;
  virtual void begin_schedule() = 0;
  virtual void end_schedule() = 0;
  virtual void finish_gradient_sync() = 0;
  // The whole model's gradient norm, every element once; `stages`: the
  // pipeline's pp group (summed over too), or null.
  virtual double grad_norm(Communicator* stages) = 0;
  // The gradients this rank holds after finish_gradient_sync (the replicated
  // model's local gradients, or ZeRO's shards); for fault injection (tests).
  virtual std::vector<std::span<float>> local_gradients() = 0;
  // AdamW with every gradient multiplied by grad_scale; fills the step's
  // communication figures into `record`.
  virtual void step(float lr, float grad_scale, StepRecord& record) = 0;
  // Waits for pending communication (after an evaluation, before reading state).
  virtual void quiesce() = 0;
  virtual int64_t step_count() const = 0;  // AdamW's bias-correction counter
  virtual void set_step_count(int64_t step) = 0;

  // The layout narrowing of this optimizer owner: the model's map as the
  // state this rank holds (DDP: replicas marked; ZeRO: cut to the shards).
  virtual layout::ShardMap shard_map(const layout::ShardMap& model_map) const = 0;
  virtual layout::StateAccess& state() = 0;
  // Parameter i (registry index, an f32 one: no compute copy) whole on every
  // rank, and adding the same `delta` to it on every rank between steps (the
  // MoE selection bias's update); collective under ZeRO-3.
  virtual std::vector<float> parameter_values(size_t i) = 0;
  virtual void add_to_parameter(size_t i, std::span<const float> delta) = 0;
  // After master values were written through state(): refresh the copies
  // the model computes with (collective under ZeRO 1/2).
  virtual void finish_load() = 0;
};

// DDP's narrowing of a model's map for dp rank `dp_rank` of `dp`: every dp
// rank holds the whole state and writes 1/dp of every piece (its part as
// replica 0, the others' as replicas).
layout::ShardMap split_replica_writes(const layout::ShardMap& model_map, int64_t dp, int64_t dp_rank);
// The same with a group per tensor (map.tensors order): the replicas of a
// routed expert's tensor are the expert-data-parallel group, not dp.
struct ReplicaGroup {
  int64_t size = 1, rank = 0;
};
layout::ShardMap split_replica_writes(const layout::ShardMap& model_map,
                                      const std::vector<ReplicaGroup>& by_tensor);
// Those groups for parameters `specs` (registry order) on dp rank `dp_rank`
// of dp under expert parallelism ep (comm/mesh.h: dp_rank = edp_rank * ep +
// ep_rank): routed experts over the dp / ep ranks holding them, the rest over dp.
std::vector<ReplicaGroup> replica_groups(const std::vector<ParamSpec>& specs, int64_t dp,
                                         int64_t dp_rank, int64_t ep);

// How the model must store its parameters for the data parallelism `config` asks for.
ParamStorage data_parallel_storage(const TrainConfig& config);

// `pipeline_micro_batches`: the schedule's micro-batches per step (0 without
// a pipeline). mesh may be null (a single process: no sharing).
std::unique_ptr<DataParallel> make_data_parallel(const TrainConfig& config, Model& model,
                                                 DeviceMesh* mesh, int64_t pipeline_micro_batches);

}  // namespace meshtrain
