#include "meshtrain/train/step_runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

// The tokens per row a rank runs: the sequence, cut over the cp ranks.
int64_t rank_seq_len(const TrainConfig& config) {
  return config.train.seq_len / config.parallel.cp;
}

// moe.aux_scope = "step": the step's routing, counted by `forward` (a
// forward-only pass over this rank's micro-batches of the step) and summed
// over the dp ranks, before their training passes (model.h step_routing).
template <typename Forward>
void count_step_routing(Model& model, DataParallel& dp, Forward&& forward) {
  if (!model.config().moe.aux_per_step) return;
  std::vector<int64_t>& counts = model.step_routing();
  std::fill(counts.begin(), counts.end(), 0);
  model.count_routing(true);
  forward();
  model.count_routing(false);
  if (Communicator* group = dp.group(); group != nullptr && !counts.empty()) {
    group->all_reduce(counts.data(), static_cast<int64_t>(counts.size()), CommDType::i64,
                      ReduceOp::sum);
  }
}

// The pipeline's view of a micro-batch, its token weights or losses attached.
pipeline::MicroBatchRef ref_of(const MicroBatch& b, const TokenLoss& loss = {}) {
  return {b.inputs.data(), b.targets.data(), positions_of(b), loss};
}

// Micro-batch k's token losses written into losses[k] (resized to it).
TokenLoss token_losses(std::vector<std::vector<float>>& losses, size_t k, const MicroBatch& b) {
  if (losses.size() <= k) losses.resize(k + 1);
  losses[k].resize(static_cast<size_t>(b.rows * b.seq_len));
  TokenLoss out;
  out.losses = losses[k].data();
  return out;
}

// Micro-batch after micro-batch through the whole (tp slice of the) model.
class LocalSteps final : public StepRunner {
 public:
  LocalSteps(Model& model, int64_t seq, uint64_t seed, StepObjective* objective)
      : model_(model), seq_(seq), seed_(seed), objective_(objective) {}
  std::string describe() const override { return ""; }
  double run(DataLoader& loader, DataParallel& dp, float grad_scale, StepRecord& r) override {
    double loss = 0;
    const int64_t m = loader.micro_batches_per_step();
    // The step's routing pass (moe.aux_scope = "step") and an objective read
    // every micro-batch first, so they are kept; otherwise each is used as the
    // loader hands it out.
    const bool keep = model_.config().moe.aux_per_step || objective_ != nullptr;
    batches_.resize(keep ? static_cast<size_t>(m) : 0);
    for (MicroBatch& batch : batches_) batch = loader.next();
    count_step_routing(model_, dp, [&] {
      for (const MicroBatch& b : batches_) {
        model_.forward_loss(b.inputs.data(), b.targets.data(), b.rows, seq_, positions_of(b));
      }
    });
    if (objective_ != nullptr) objective_->prepare(batches_, *this);
    for (int64_t a = 0; a < m; ++a) {
      const MicroBatch& batch = keep ? batches_[static_cast<size_t>(a)] : loader.next();
      dp.begin_micro_batch(a == 0, a + 1 == m);
      // LoRA dropout masks keyed by (seed, step, sample, position): layout-independent.
      if (model_.config().lora.dropout > 0) model_.set_lora_dropout(seed_, r.step, batch.samples);
      const TokenLoss weights = objective_ ? objective_->token_loss(static_cast<size_t>(a))
                                           : TokenLoss{};
      loss += model_.forward_backward(batch.inputs.data(), batch.targets.data(), batch.rows, seq_,
                                      grad_scale, positions_of(batch), weights);
    }
    return objective_ ? objective_->finish(nullptr, dp.group(), r) : loss;
  }
  double evaluate(ValidationSet& val, int64_t& tokens) override {
    if (objective_ != nullptr) return objective_->evaluate(val, *this, tokens);
    return validation_loss_sum(model_, val, batch_, tokens);
  }
  Communicator* stages() override { return nullptr; }
  void forward_losses(std::span<const MicroBatch> batches,
                      std::vector<std::vector<float>>& losses) override {
    for (size_t k = 0; k < batches.size(); ++k) {
      const MicroBatch& b = batches[k];
      model_.forward_loss(b.inputs.data(), b.targets.data(), b.rows, seq_, positions_of(b),
                          token_losses(losses, k, b));
    }
  }

 private:
  Model& model_;
  int64_t seq_;
  uint64_t seed_;
  StepObjective* objective_;
  MicroBatch batch_;
  std::vector<MicroBatch> batches_;  // the step's, for its routing pass or objective
};

// The schedule's actions over this rank's stage; the tied embedding's
// gradient summed between the first and last stages.
class PipelineSteps final : public StepRunner {
 public:
  PipelineSteps(const TrainConfig& config, Model& model, DeviceMesh& mesh,
                const pipeline::PipelineShape& shape, int64_t rows, StepObjective* objective)
      : model_(model), pp_(mesh.pp()), split_(pp_split_layers(config)), objective_(objective) {
    const pipeline::ScheduleKind kind = pipeline::parse_schedule_kind(config.parallel.schedule);
    executor_ = std::make_unique<pipeline::Executor>(model, pp_, kind, shape, rows,
                                                     rank_seq_len(config));
    const StageLayers& stage = model.stage_layers();
    if (config.model.tie_embeddings) {
      const bool ends = stage.first || stage.last;
      tied_ = pp_.split(ends ? 0 : 1, pp_.rank(), "pp_tied");
      if (!ends) tied_.reset();  // the middle stages' group is not used
    }
    n_layers_ = config.model.n_layers;
  }

  std::string describe() const override {
    const pipeline::PipelineShape& shape = executor_->shape();
    std::string layers;
    for (const auto& [first, end] : pipeline::split_layers(n_layers_, shape.total_stages(), split_)) {
      layers += fmt::format("{}{}", layers.empty() ? "" : ",", end - first);
    }
    // The schedule as the simulator runs it (backward = 2 forward).
    return fmt::format(
        "pipeline: {} stages x {} virtual, schedule {}, {} micro-batches per step, layers per "
        "stage {}, theoretical bubble {:.3f}\n{}",
        shape.stages, shape.virtual_stages, pipeline::schedule_kind_name(executor_->kind()),
        shape.micro_batches, layers, pipeline::theoretical_bubble(shape),
        pipeline::format_timeline(
            pipeline::simulate(pipeline::make_schedule(executor_->kind(), shape), shape), shape));
  }

  double run(DataLoader& loader, DataParallel& dp, float grad_scale, StepRecord& r) override {
    const int64_t m = loader.micro_batches_per_step();
    batches_.resize(static_cast<size_t>(m));
    std::vector<pipeline::MicroBatchRef> refs;
    for (MicroBatch& batch : batches_) {
      batch = loader.next();
      refs.push_back(ref_of(batch));
    }
    count_step_routing(model_, dp, [&] { executor_->evaluate(refs); });
    if (objective_ != nullptr) {
      objective_->prepare(batches_, *this);
      for (size_t k = 0; k < refs.size(); ++k) refs[k].loss = objective_->token_loss(k);
    }
    dp.begin_schedule();
    double loss = executor_->run(refs, grad_scale);
    if (tied_ && model_.params()[0].spec.trainable) {
      // The first stage's embedding and the last stage's output layer are one
      // parameter: both get the sum of their gradients, so both updates agree.
      Parameter& embedding = model_.params()[0];
      tied_->all_reduce(embedding.grad.data<float>(), embedding.spec.numel(), CommDType::f32,
                        ReduceOp::sum);
    }
    dp.end_schedule();
    const pipeline::StepTiming& timing = executor_->last_timing();
    r.pipelined = true;
    r.pp_busy_ms = timing.busy_seconds * 1e3;
    r.pp_wait_ms = timing.wait_seconds * 1e3;
    r.pp_schedule_ms = timing.total_seconds * 1e3;
    r.pp_bubble = timing.busy_seconds > 0
                      ? (timing.total_seconds - timing.busy_seconds) / timing.busy_seconds
                      : 0.0;
    r.pp_bubble_theory = pipeline::theoretical_bubble(executor_->shape());
    r.pp_in_flight = static_cast<int64_t>(timing.peak_in_flight);
    if (objective_ != nullptr) loss = objective_->finish(&pp_, dp.group(), r);
    return sum_over_ranks(pp_, loss);
  }

  double evaluate(ValidationSet& val, int64_t& tokens) override {
    if (objective_ != nullptr) return sum_over_ranks(pp_, objective_->evaluate(val, *this, tokens));
    std::vector<MicroBatch> batches(static_cast<size_t>(val.num_micro_batches()));
    std::vector<pipeline::MicroBatchRef> refs;
    for (int64_t k = 0; k < val.num_micro_batches(); ++k) {
      MicroBatch& b = batches[static_cast<size_t>(k)];
      val.read(k, b);
      tokens += count_loss_tokens(b);
      // The stages agreed on one message size: the training micro-batch's.
      MESHTRAIN_CHECK(b.rows == executor_->micro_batch_rows(),
                      "evaluate: validation micro-batch of {} rows; the pipeline runs {}", b.rows,
                      executor_->micro_batch_rows());
      refs.push_back(ref_of(b));
    }
    return sum_over_ranks(pp_, executor_->evaluate(refs));
  }
  Communicator* stages() override { return &pp_; }
  void forward_losses(std::span<const MicroBatch> batches,
                      std::vector<std::vector<float>>& losses) override {
    std::vector<pipeline::MicroBatchRef> refs;
    for (size_t k = 0; k < batches.size(); ++k) {
      refs.push_back(ref_of(batches[k], token_losses(losses, k, batches[k])));
    }
    executor_->evaluate(refs);
  }

 private:
  Model& model_;
  Communicator& pp_;
  std::vector<int64_t> split_;
  int64_t n_layers_ = 0;
  std::unique_ptr<pipeline::Executor> executor_;
  StepObjective* objective_;
  std::unique_ptr<Communicator> tied_;  // first and last stages (tied embeddings)
  std::vector<MicroBatch> batches_;
};

pipeline::PipelineShape pipeline_shape(const TrainConfig& config, int64_t micro_batches) {
  return {config.parallel.pp, static_cast<int>(micro_batches), config.parallel.virtual_stages};
}

}  // namespace

StageLayers stage_of(const TrainConfig& config, const DeviceMesh* mesh, int64_t micro_batches) {
  const int pp = config.parallel.pp;
  if (pp == 1) return {};
  MESHTRAIN_CHECK(mesh != nullptr,
                  "parallel.pp = {} needs a communicator: run through `meshtrain train` (or pass "
                  "TrainerOptions::mesh)",
                  pp);
  const pipeline::PipelineShape shape = pipeline_shape(config, micro_batches);
  pipeline::check_shape(pipeline::parse_schedule_kind(config.parallel.schedule), shape);
  return pipeline::stage_layers(config.model.n_layers, shape, mesh->coord().pp,
                                pp_split_layers(config));
}

std::unique_ptr<StepRunner> make_step_runner(const TrainConfig& config, Model& model,
                                             DeviceMesh* mesh, int64_t micro_batches,
                                             int64_t micro_batch_rows,
                                             StepObjective* objective) {
  if (config.parallel.pp == 1) {
    return std::make_unique<LocalSteps>(model, rank_seq_len(config), config.train.seed, objective);
  }
  return std::make_unique<PipelineSteps>(config, model, *mesh,
                                         pipeline_shape(config, micro_batches), micro_batch_rows,
                                         objective);
}

}  // namespace meshtrain
