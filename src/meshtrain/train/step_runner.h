// How a step's micro-batches run on this rank: a local loop of
// forward/backward, or a pipeline schedule over the stages. Chosen by
// make_step_runner from the config; the trainer never asks which.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/model/model.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data_parallel.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

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
};

// The model's pipeline stage (StageLayers) for the config, on this mesh
// coordinate (the whole model without a pipeline).
StageLayers stage_of(const TrainConfig& config, const DeviceMesh* mesh, int64_t micro_batches);

// mesh may be null (no pipeline). `micro_batch_rows`: rows per micro-batch.
std::unique_ptr<StepRunner> make_step_runner(const TrainConfig& config, Model& model,
                                             DeviceMesh* mesh, int64_t micro_batches,
                                             int64_t micro_batch_rows);

}  // namespace meshtrain
