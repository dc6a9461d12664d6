#include "meshtrain/optim/adamw.h"

#include <cstring>

#include "meshtrain/backend/cpu/adamw.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

void check_adamw_config(const AdamWConfig& config) {
  MESHTRAIN_CHECK(config.beta1 >= 0 && config.beta1 < 1, "optim.beta1 must be in [0, 1), got {}",
                  config.beta1);
  MESHTRAIN_CHECK(config.beta2 >= 0 && config.beta2 < 1, "optim.beta2 must be in [0, 1), got {}",
                  config.beta2);
  MESHTRAIN_CHECK(config.eps > 0, "optim.eps must be > 0, got {}", config.eps);
  MESHTRAIN_CHECK(config.weight_decay >= 0, "optim.weight_decay must be >= 0, got {}",
                  config.weight_decay);
}

cpu::AdamWHyper adamw_hyper(const AdamWConfig& config, const ParamSpec& spec, float lr,
                            int64_t step, float grad_scale) {
  cpu::AdamWHyper hyper;
  hyper.lr = lr;
  hyper.beta1 = config.beta1;
  hyper.beta2 = config.beta2;
  hyper.eps = config.eps;
  hyper.weight_decay = spec.role == ParamRole::decay ? config.weight_decay : 0.0f;
  hyper.step = step;
  hyper.grad_scale = grad_scale;
  return hyper;
}

AdamW::AdamW(Model& model, const AdamWConfig& config)
    : model_(model),
      config_(config),
      exp_avg_({model.num_params()}, DType::f32, MemCategory::optimizer, model.ctx().tracker()),
      exp_avg_sq_({model.num_params()}, DType::f32, MemCategory::optimizer,
                  model.ctx().tracker()) {
  check_adamw_config(config);
}

void AdamW::step(float lr, float grad_scale) {
  ++step_count_;
  float* m = exp_avg_.data<float>();
  float* v = exp_avg_sq_.data<float>();
  // Per parameter, so weight decay follows the role (never the tensor's index).
  for (Parameter& p : model_.params()) {
    cpu::AdamWHyper hyper = adamw_hyper(config_, p.spec, lr, step_count_, grad_scale);
    cpu::ComputeCopy compute;
    if (p.compute.defined()) compute = cpu::ComputeCopy(p.compute.raw(), p.compute.dtype());
    cpu::adamw_update(hyper, p.master.data<float>(), p.grad.data<float>(), m + p.offset,
                      v + p.offset, compute, p.spec.numel());
  }
}

namespace {

Tensor& state_tensor(Model& model, Tensor& exp_avg, Tensor& exp_avg_sq, layout::StateKind kind) {
  switch (kind) {
    case layout::StateKind::master: return model.flat_master();
    case layout::StateKind::exp_avg: return exp_avg;
    case layout::StateKind::exp_avg_sq: return exp_avg_sq;
  }
  fail("adamw: unknown state kind");
}

}  // namespace

void AdamW::read(layout::StateKind kind, int64_t offset, int64_t count, float* out) {
  const Tensor& t = state_tensor(model_, exp_avg_, exp_avg_sq_, kind);
  MESHTRAIN_CHECK(offset >= 0 && count >= 0 && offset + count <= t.numel(),
                  "adamw: state range [{}, {}) outside {} elements", offset, offset + count,
                  t.numel());
  std::memcpy(out, t.data<float>() + offset, static_cast<size_t>(count) * sizeof(float));
}

void AdamW::write(layout::StateKind kind, int64_t offset, int64_t count, const float* in) {
  Tensor& t = state_tensor(model_, exp_avg_, exp_avg_sq_, kind);
  MESHTRAIN_CHECK(offset >= 0 && count >= 0 && offset + count <= t.numel(),
                  "adamw: state range [{}, {}) outside {} elements", offset, offset + count,
                  t.numel());
  std::memcpy(t.data<float>() + offset, in, static_cast<size_t>(count) * sizeof(float));
}

}  // namespace meshtrain
