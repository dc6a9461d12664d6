// How a step's micro-batches run on this rank: a local loop of
// forward/backward, or a pipeline schedule over the stages. Chosen by
// make_step_runner from the config; the trainer never asks which.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/model/model.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data_parallel.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

class StepRunner;

// What a step trains on, when it is not the plain sum of token losses
// (language modelling, SFT): an objective that reads the step's micro-batches
// first, may run forward-only passes over them (StepRunner::forward_losses),
// and weighs each token's loss in the training passes (TokenLoss: from the
// pass's own token losses; preference optimisation,
// train/preference_objective.h). Plugged into a runner; the trainer never
// asks which.
class StepObjective {
 public:
  virtual ~StepObjective() = default;
  // Once before the first step, the model holding the run's starting or
  // resumed weights: what the objective needs of the whole run (a
  // precomputed reference). Collective over every rank.
  virtual void start(StepRunner& runner, bool resumed) {}
  // Before the step's training passes, with all of its micro-batches on this
  // rank (they stay valid until finish).
  virtual void prepare(std::span<const MicroBatch> batches, StepRunner& runner) = 0;
  // Micro-batch k's TokenLoss for its training pass, after prepare.
  virtual TokenLoss token_loss(size_t k) = 0;
  // After the step's passes: its statistics summed over the pipeline's
  // stages and the dp ranks (either group may be null) into r (collective).
  // Returns the step's objective sum over this rank's samples (the stage
  // holding the head; 0 on the others): the value whose mean over the step's
  // loss tokens (data/sampler.h loss_tokens) is its loss.
  virtual double finish(Communicator* stages, Communicator* dp, StepRecord& r) = 0;
  // The validation set's objective sum on this rank (the stage holding the
  // head; 0 on the others) for the model's current weights; adds the units
  // its mean is over (a preference row's pairs) to `units` on every stage.
  virtual double evaluate(const ValidationSet& val, StepRunner& runner, int64_t& units) = 0;
};

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Console lines describing the runner (empty for the local loop).
  virtual std::string describe() const = 0;
  // Runs the step's micro-batches from `loader` (gradients added with
  // grad_scale, `dp` told where micro-batches begin) and returns the step's
  // loss sum over this dp rank's tokens, the whole model's (stages summed).
  virtual double run(DataLoader& loader, DataParallel& dp, float grad_scale, StepRecord& r) = 0;
  // The loss sum of the validation set on this dp rank (the whole model);
  // adds its tokens to `tokens`.
  virtual double evaluate(ValidationSet& val, int64_t& tokens) = 0;
  // The pipeline's pp group (gradient norms sum over it), or null.
  virtual Communicator* stages() = 0;
  // Forward only, no gradients: each token's loss of `batches` (micro-batches
  // of the step's shape) into losses[k] (resized to rows * seq), on the stage
  // holding the head (untouched elsewhere).
  virtual void forward_losses(std::span<const MicroBatch> batches,
                              std::vector<std::vector<float>>& losses) = 0;
};

// The model's pipeline stage (StageLayers) for the config, on this mesh
// coordinate (the whole model without a pipeline).
StageLayers stage_of(const TrainConfig& config, const DeviceMesh* mesh, int64_t micro_batches);

// mesh may be null (no pipeline). `micro_batch_rows`: rows per micro-batch.
// `objective` (may be null: the token losses' sum) must outlive the runner.
std::unique_ptr<StepRunner> make_step_runner(const TrainConfig& config, Model& model,
                                             DeviceMesh* mesh, int64_t micro_batches,
                                             int64_t micro_batch_rows,
                                             StepObjective* objective = nullptr);

}  // namespace meshtrain
