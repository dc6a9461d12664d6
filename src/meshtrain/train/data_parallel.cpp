#include "meshtrain/train/data_parallel.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/ddp/ddp.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/parallel/zero/sharded.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
layout::ShardMap split_replica_writes(const layout::ShardMap& model_map, int64_t dp, int64_t dp_rank) {
  return split_replica_writes(model_map,
                              std::vector<ReplicaGroup>(model_map.tensors.size(), {dp, dp_rank}));
}

std::vector<ReplicaGroup> replica_groups(const std::vector<ParamSpec>& specs, int64_t dp,
                                         int64_t dp_rank, int64_t ep) {
  std::vector<ReplicaGroup> groups;
  for (const ParamSpec& spec : specs) {
    groups.push_back(ep > 1 && spec.expert ? ReplicaGroup{dp / ep, dp_rank / ep}
                                           : ReplicaGroup{dp, dp_rank});
  }
  return groups;
}

layout::ShardMap split_replica_writes(const layout::ShardMap& model_map,
                                      const std::vector<ReplicaGroup>& by_tensor) {
  layout::ShardMap map;
  map.tensors = model_map.tensors;
  map.local_numel = model_map.local_numel;
  for (const layout::ShardPiece& p : model_map.pieces) {
    const int64_t n = p.region.numel();
    const auto [dp, dp_rank] = by_tensor[p.tensor];
    for (int64_t part = 0; part < dp; ++part) {
      const int64_t begin = n * part / dp, end = n * (part + 1) / dp;
      if (begin == end) continue;
      layout::ShardPiece q = p;
      q.region = layout::narrow_region(p.region, begin, end);
      q.local_offset = p.local_offset + begin;
      if (part != dp_rank || p.replica != 0) q.replica = std::max(p.replica, 1);
      map.pieces.push_back(std::move(q));
    }
  }
  return map;
}

namespace {

// Every rank holds the whole (stage / tp slice of the) model and a flat
// AdamW; with dp > 1 DDP averages the gradients.
class ReplicatedDataParallel final : public DataParallel {
 public:
  ReplicatedDataParallel(const TrainConfig& config, Model& model, DeviceMesh* mesh, bool pipelined)
      : model_(model), optimizer_(model, config.optim.adamw) {
    if (mesh != nullptr && mesh->replicas().size() > 1) {
      // Pipelines reduce once, after the schedule's last backward. Under
      // expert parallelism the experts' gradients average over their group.
      ddp_ = std::make_unique<DistributedDataParallel>(
          model, mesh->replicas(),
          DdpOptions{config.parallel.bucket_mb, config.parallel.overlap && !pipelined},
          model.expert_parallel().active() ? &mesh->edp() : nullptr);
      overlap_ = config.parallel.overlap;
      bucket_mb_ = config.parallel.bucket_mb;
    }
  }

  std::string describe() const override {
    if (!ddp_) return "no gradient sync (dp 1)";
    return fmt::format("DDP: {} gradient buckets of <= {} MiB, overlap {}", ddp_->buckets().size(),
                       bucket_mb_, overlap_ ? "on" : "off");
  }
  Communicator* group() override { return ddp_ ? &ddp_->dp() : nullptr; }
  void init_weights(uint64_t seed) override { model_.init_weights(seed); }
  // The last applied step's update cleared the gradients; a skipped step's
  // (the gates') are cleared here.
  void begin_step() override {
    if (!grads_clear_) model_.zero_grads();
    grads_clear_ = false;
  }
  void begin_micro_batch(bool first, bool last) override {
    if (ddp_) ddp_->begin_micro_batch(last);
  }
  void begin_schedule() override {}
  void end_schedule() override {
    if (ddp_) ddp_->begin_micro_batch(true);  // the one reduction, after the schedule
  }
  void finish_gradient_sync() override {
    if (ddp_) ddp_->finish_gradient_sync();
  }
  double grad_norm(Communicator* stages) override {
    return stages != nullptr ? pipeline::pipeline_grad_norm(model_, *stages)
                             : tensor_parallel_grad_norm(model_);
  }
  std::vector<std::span<float>> local_gradients() override {
    std::vector<std::span<float>> out;
    for (Parameter& p : model_.params()) {
      if (p.grad.defined()) out.emplace_back(p.grad.data<float>(), static_cast<size_t>(p.grad.numel()));
    }
    return out;
  }
  void step(float lr, float grad_scale, StepRecord& r) override {
    optimizer_.step(lr, grad_scale, /*clear_grads=*/true);
    grads_clear_ = true;
    if (!ddp_) return;
    r.comm_ms = ddp_->last_sync().comm_seconds * 1e3;
    r.exposed_comm_ms = ddp_->last_sync().exposed_seconds * 1e3;
    for (const CallRecord& call : ddp_->last_sync().calls) r.comm_bytes += call.bytes;
  }
  void quiesce() override {}
  int64_t step_count() const override { return optimizer_.step_count(); }
  void set_step_count(int64_t step) override { optimizer_.set_step_count(step); }

  layout::ShardMap shard_map(const layout::ShardMap& model_map) const override {
    if (!ddp_) return model_map;
    // The map's tensors are the model's parameters, in registry order.
    std::vector<ParamSpec> specs;
    for (const Parameter& p : model_.params()) specs.push_back(p.spec);
    return split_replica_writes(model_map, replica_groups(specs, ddp_->dp().size(),
                                                         ddp_->dp().rank(),
                                                         model_.expert_parallel().size()));
  }
  layout::StateAccess& state() override { return optimizer_; }
  void finish_load() override { model_.sync_compute_weights(); }
  std::vector<float> parameter_values(size_t i) override {
    const Parameter& p = model_.params()[i];
    std::vector<float> values(static_cast<size_t>(p.spec.numel()));
    model_.copy_master_to_host(p, values.data());
    return values;
  }
  void add_to_parameter(size_t i, std::span<const float> delta) override {
    model_.add_to_master(model_.params()[i], delta);
  }

 private:
  Model& model_;
  AdamW optimizer_;
  std::unique_ptr<DistributedDataParallel> ddp_;  // after optimizer_: uses the model's hooks
  bool overlap_ = true;
  double bucket_mb_ = 0;
  bool grads_clear_ = false;  // the flat gradients are all 0 (step() left them so)
};

// ZeRO: optimizer state (1), + gradients (2), + parameters (3) sharded over dp.
class ZeroDataParallel final : public DataParallel {
 public:
  ZeroDataParallel(const TrainConfig& config, Model& model, DeviceMesh& mesh,
                   int64_t pipeline_micro_batches) {
    zero::ZeroOptions options = zero_options(config);
    if (options.offload.tier == zero::OffloadTier::disk) {
      // A killed attempt's store files: every rank clears its host's; the sum
      // (an all-reduce) also keeps any rank from opening its own store before
      // every rank has cleared.
      const double stale = sum_over_ranks(
          mesh.world(),
          zero::remove_offload_files(options.offload.directory, options.offload.file_prefix));
      if (stale > 0 && mesh.rank() == 0) {
        fmt::print("offload: removed {} stale file(s) of this run from {}\n", stale,
                   options.offload.directory);
      }
    }
    // Pipelines: each unit's gradients reduced once, after its last backward.
    options.pipeline_micro_batches = pipeline_micro_batches;
    // Under expert parallelism the experts' state is sharded over their group.
    zero_ = std::make_unique<zero::ShardedDataParallel>(
        model, mesh.replicas(), config.optim.adamw, options,
        model.expert_parallel().active() ? &mesh.edp() : nullptr);
  }

  std::string describe() const override { return describe_zero(*zero_); }
  Communicator* group() override { return &zero_->dp(); }
  void init_weights(uint64_t seed) override { zero_->init_weights(seed); }
  void begin_step() override {}
  void begin_micro_batch(bool first, bool last) override { zero_->begin_micro_batch(first, last); }
  // ZeRO counts each unit's backwards from here.
  void begin_schedule() override { zero_->begin_micro_batch(true, true); }
  void end_schedule() override {}
  void finish_gradient_sync() override { zero_->finish_gradient_sync(); }
  double grad_norm(Communicator* stages) override { return zero_->grad_norm(stages); }
  std::vector<std::span<float>> local_gradients() override { return zero_->grad_shards(); }
  void step(float lr, float grad_scale, StepRecord& r) override {
    zero_->step(lr, grad_scale);
    // The step's collectives: reduce-scatters, and the gathers waited for in it.
    const zero::ZeroStepTiming& timing = zero_->last_step();
    r.comm_ms = timing.comm_seconds * 1e3;
    r.exposed_comm_ms = timing.exposed_seconds * 1e3;
    r.comm_bytes = timing.bytes;
    r.offloaded = zero_->options().offload.tier != zero::OffloadTier::none;
    r.offload_read_bytes = timing.offload.bytes_read;
    r.offload_written_bytes = timing.offload.bytes_written;
    r.offload_ready = timing.offload.ready_at_acquire;
    r.offload_waited = timing.offload.waited_at_acquire;
  }
  void quiesce() override { zero_->quiesce(); }
  int64_t step_count() const override { return zero_->step_count(); }
  void set_step_count(int64_t step) override { zero_->set_step_count(step); }

  layout::ShardMap shard_map(const layout::ShardMap& model_map) const override {
    return zero_->shard_map(model_map);
  }
  layout::StateAccess& state() override { return *zero_; }
  void finish_load() override { zero_->finish_load(); }
  std::vector<float> parameter_values(size_t i) override { return zero_->parameter_values(i); }
  void add_to_parameter(size_t i, std::span<const float> delta) override {
    zero_->add_to_parameter(i, delta);
  }

 private:
  std::unique_ptr<zero::ShardedDataParallel> zero_;
};

}  // namespace

ParamStorage data_parallel_storage(const TrainConfig& config) {
  return config.parallel.zero > 0 ? ParamStorage::external : ParamStorage::flat;
}

std::unique_ptr<DataParallel> make_data_parallel(const TrainConfig& config, Model& model,
                                                 DeviceMesh* mesh, int64_t pipeline_micro_batches) {
  if (config.parallel.zero == 0) {
    return std::make_unique<ReplicatedDataParallel>(config, model, mesh,
                                                    pipeline_micro_batches > 0);
  }
  MESHTRAIN_CHECK(mesh != nullptr,
                  "parallel.zero = {} needs a communicator: run through `meshtrain train` (or "
                  "pass TrainerOptions::mesh)",
                  config.parallel.zero);
  return std::make_unique<ZeroDataParallel>(config, model, *mesh, pipeline_micro_batches);
}

}  // namespace meshtrain
