// AdamW over the model's flat parameter buffers: fp32 master weights, fp32
// moments, decoupled weight decay applied only to parameters whose role is
// `decay`, bias correction. Writes the bf16 compute copies when the model
// runs in bf16.
#pragma once

#include <cstdint>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/model.h"
#include "meshtrain/parallel/layout/shard_map.h"

namespace meshtrain {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

// Throws Error naming the first invalid optim.* field.
void check_adamw_config(const AdamWConfig& config);
// The kernel's hyperparameters for one parameter: weight decay by its role.
ops::AdamWHyper adamw_hyper(const AdamWConfig& config, const ParamSpec& spec, float lr,
                            int64_t step, float grad_scale);

// As a StateAccess: the local state space is the model's flat layout (master
// = the model's flat master buffer, the moments alongside); after writing
// master values call Model::sync_compute_weights.
class AdamW : public layout::StateAccess {
 public:
  AdamW(Model& model, const AdamWConfig& config);
  void read(layout::StateKind kind, int64_t offset, int64_t count, float* out) override;
  void write(layout::StateKind kind, int64_t offset, int64_t count, const float* in) override;

  // One update with learning rate lr; every gradient is first multiplied by
  // grad_scale (the clipping factor, 1 when not clipping). Increments step_count.
  // clear_grads: the trainable parameters' gradients are left at 0 by the same
  // pass (then Model::zero_grads before the next step has nothing to do).
  void step(float lr, float grad_scale = 1.0f, bool clear_grads = false);

  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t step) { step_count_ = step; }
  const AdamWConfig& config() const { return config_; }
  Tensor& exp_avg() { return exp_avg_; }        // flat, the layout of the model's flat grad buffer
  Tensor& exp_avg_sq() { return exp_avg_sq_; }

 private:
  Model& model_;
  AdamWConfig config_;
  Tensor exp_avg_, exp_avg_sq_;  // category optimizer
  int64_t step_count_ = 0;
};

}  // namespace meshtrain
