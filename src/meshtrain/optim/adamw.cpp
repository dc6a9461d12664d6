#include "meshtrain/optim/adamw.h"

#include <algorithm>

#include "meshtrain/backend/backend.h"
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

ops::AdamWHyper adamw_hyper(const AdamWConfig& config, const ParamSpec& spec, float lr,
                            int64_t step, float grad_scale) {
  ops::AdamWHyper hyper;
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
      exp_avg_(model.backend().allocate({model.num_trainable()}, DType::f32,
                                        MemCategory::optimizer)),
      exp_avg_sq_(model.backend().allocate({model.num_trainable()}, DType::f32,
                                           MemCategory::optimizer)) {
  check_adamw_config(config);
}

void AdamW::step(float lr, float grad_scale, bool clear_grads) {
  ++step_count_;
  float* m = exp_avg_.data<float>();
  float* v = exp_avg_sq_.data<float>();
  // Per parameter, so weight decay follows the role (never the tensor's index).
  for (Parameter& p : model_.params()) {
    if (!p.spec.trainable) continue;  // frozen (LoRA's base): never written
    ops::AdamWHyper hyper = adamw_hyper(config_, p.spec, lr, step_count_, grad_scale);
    hyper.clear_grad = clear_grads;
    ops::ComputeCopy compute;
    if (p.compute.defined()) compute = ops::ComputeCopy(p.compute.raw(), p.compute.dtype());
    model_.backend().adamw_update(hyper, p.master.data<float>(), p.grad.data<float>(),
                                  m + p.grad_offset, v + p.grad_offset, compute, p.spec.numel());
  }
}

namespace {

// The moments of state-space elements [offset, offset + count): trainable
// parameters' live at their grad_offset; frozen ones have none (read as 0,
// writes dropped).
template <typename Fn>
void for_each_moment_run(Model& model, int64_t offset, int64_t count, Fn&& fn) {
  MESHTRAIN_CHECK(offset >= 0 && count >= 0 && offset + count <= model.num_params(),
                  "adamw: state range [{}, {}) outside {} elements", offset, offset + count,
                  model.num_params());
  for_each_state_run(model.params(), offset, count,
                     [&](const Parameter& p, int64_t at, int64_t n, int64_t pos) {
                       fn(p.spec.trainable ? p.grad_offset + at : -1, n, pos);
                     });
}

}  // namespace

void AdamW::read(layout::StateKind kind, int64_t offset, int64_t count, float* out) {
  if (kind == layout::StateKind::master) return model_.read_values(offset, count, out);
  const Tensor& t = kind == layout::StateKind::exp_avg ? exp_avg_ : exp_avg_sq_;
  Backend& backend = model_.backend();
  backend.synchronize();
  for_each_moment_run(model_, offset, count, [&](int64_t at, int64_t n, int64_t pos) {
    if (at < 0) {
      std::fill_n(out + pos, n, 0.0f);
    } else {
      backend.copy_to_host(t.view(at, {n}), out + pos);
    }
  });
}

void AdamW::write(layout::StateKind kind, int64_t offset, int64_t count, const float* in) {
  if (kind == layout::StateKind::master) return model_.write_values(offset, count, in);
  const Tensor& t = kind == layout::StateKind::exp_avg ? exp_avg_ : exp_avg_sq_;
  for_each_moment_run(model_, offset, count, [&](int64_t at, int64_t n, int64_t pos) {
    if (at >= 0) model_.backend().copy_from_host(in + pos, t.view(at, {n}));
  });
}

}  // namespace meshtrain
