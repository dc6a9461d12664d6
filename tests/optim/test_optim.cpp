// AdamW against a float64 reference written here, the LR schedule's values,
// and gradient-norm clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "support/tiny_models.h"
#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/optim/schedule.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/rng.h"

namespace meshtrain {
namespace {

ModelConfig tiny_llama() { return testing::tiny_llama(/*tied=*/false); }

void fill_grads(Model& model, uint64_t key) {
  float* g = model.flat_grad().data<float>();
  for (int64_t i = 0; i < model.num_params(); ++i) g[i] = normal_at(key, i) * 0.1f;
}

struct Reference {
  std::vector<double> p, m, v;
};

// One AdamW step in float64, per element: PyTorch's torch.optim.AdamW formula.
void reference_step(const Model& model, Reference& ref, const AdamWConfig& cfg, double lr,
                    double grad_scale, int64_t step) {
  double bc1 = 1.0 - std::pow(double(cfg.beta1), double(step));
  double bc2 = 1.0 - std::pow(double(cfg.beta2), double(step));
  for (const Parameter& p : model.params()) {
    double wd = p.spec.role == ParamRole::decay ? cfg.weight_decay : 0.0;
    const float* g = p.grad.data<float>();
    for (int64_t i = 0; i < p.spec.numel(); ++i) {
      size_t k = static_cast<size_t>(p.offset + i);
      double grad = double(g[i]) * grad_scale;
      ref.m[k] = cfg.beta1 * ref.m[k] + (1.0 - cfg.beta1) * grad;
      ref.v[k] = cfg.beta2 * ref.v[k] + (1.0 - cfg.beta2) * grad * grad;
      double m_hat = ref.m[k] / bc1, v_hat = ref.v[k] / bc2;
      ref.p[k] -= lr * (m_hat / (std::sqrt(v_hat) + cfg.eps) + wd * ref.p[k]);
    }
  }
}

void run_against_reference(Precision precision) {
  MemoryTracker tracker;
  cpu::CpuBackend ctx(2, tracker);
  Model model(tiny_llama(), precision, ctx);
  model.init_weights(7);
  AdamWConfig cfg;
  cfg.beta1 = 0.9f;
  cfg.beta2 = 0.95f;
  cfg.eps = 1e-8f;
  cfg.weight_decay = 0.1f;
  AdamW opt(model, cfg);

  const float* master = model.flat_master().data<float>();
  int64_t n = model.num_params();
  Reference ref{std::vector<double>(master, master + n), std::vector<double>(n, 0.0),
                std::vector<double>(n, 0.0)};
  const float lrs[] = {1e-3f, 3e-3f, 2e-3f, 5e-4f, 1e-3f};
  const float scales[] = {1.0f, 0.5f, 1.0f, 0.25f, 1.0f};
  for (int s = 0; s < 5; ++s) {
    fill_grads(model, 100 + s);
    reference_step(model, ref, cfg, lrs[s], scales[s], s + 1);
    opt.step(lrs[s], scales[s]);
    ASSERT_EQ(opt.step_count(), s + 1);
  }
  // Moments: float32 rounding against terms of size ~(1 - beta) * grad.
  const float* m = opt.exp_avg().data<float>();
  const float* v = opt.exp_avg_sq().data<float>();
  double max_err = 0;
  for (int64_t i = 0; i < n; ++i) {
    double err = std::abs(master[i] - ref.p[i]) / (std::abs(ref.p[i]) + 1e-3);
    max_err = std::max(max_err, err);
    ASSERT_NEAR(m[i], ref.m[i], 1e-6 * (std::abs(ref.m[i]) + 1e-2)) << "exp_avg " << i;
    ASSERT_NEAR(v[i], ref.v[i], 1e-6 * (std::abs(ref.v[i]) + 1e-4)) << "exp_avg_sq " << i;
  }
  EXPECT_LT(max_err, 1e-5);

  // bf16: the compute copies are the rounded master weights.
  for (const Parameter& p : model.params()) {
    if (!p.compute.defined()) continue;
    ASSERT_EQ(precision, Precision::bf16);
    for (int64_t i = 0; i < p.spec.numel(); ++i) {
      ASSERT_EQ(p.compute.data<bf16>()[i].bits, float_to_bf16(p.master.data<float>()[i]).bits)
          << p.spec.name << "[" << i << "]";
    }
  }
}

TEST(AdamW, MatchesFloat64ReferenceFp32) { run_against_reference(Precision::fp32); }
TEST(AdamW, MatchesFloat64ReferenceBf16) { run_against_reference(Precision::bf16); }

TEST(AdamW, WeightDecayOnlyForDecayRole) {
  MemoryTracker tracker;
  cpu::CpuBackend ctx(1, tracker);
  Model model(tiny_llama(), Precision::fp32, ctx);
  model.init_weights(3);
  std::vector<float> before(model.flat_master().data<float>(),
                            model.flat_master().data<float>() + model.num_params());
  model.zero_grads();
  AdamWConfig cfg;
  cfg.weight_decay = 0.5f;
  AdamW opt(model, cfg);
  opt.step(0.1f);
  bool saw_decay = false, saw_no_decay = false;
  for (const Parameter& p : model.params()) {
    for (int64_t i = 0; i < p.spec.numel(); ++i) {
      float old = before[static_cast<size_t>(p.offset + i)];
      float now = p.master.data<float>()[i];
      if (p.spec.role == ParamRole::no_decay) {
        ASSERT_EQ(now, old) << p.spec.name;
      } else {
        ASSERT_FLOAT_EQ(now, old * (1.0f - 0.1f * 0.5f)) << p.spec.name;
      }
    }
    (p.spec.role == ParamRole::decay ? saw_decay : saw_no_decay) = true;
  }
  EXPECT_TRUE(saw_decay);
  EXPECT_TRUE(saw_no_decay);
}

TEST(LrSchedule, WarmupThenCosine) {
  LrSchedule s;
  s.max_lr = 1e-3f;
  s.min_lr = 1e-4f;
  s.warmup_steps = 10;
  s.total_steps = 110;
  s.decay = LrDecay::cosine;
  EXPECT_FLOAT_EQ(s.at(0), 1e-4f);     // 1/10 of max
  EXPECT_FLOAT_EQ(s.at(4), 5e-4f);
  EXPECT_FLOAT_EQ(s.at(9), 1e-3f);     // warm-up reaches max
  EXPECT_FLOAT_EQ(s.at(10), 1e-3f);    // cosine starts at max
  EXPECT_FLOAT_EQ(s.at(60), 5.5e-4f);  // halfway: (max + min) / 2
  EXPECT_NEAR(s.at(35), 1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-9);
  EXPECT_FLOAT_EQ(s.at(110), 1e-4f);
  EXPECT_FLOAT_EQ(s.at(500), 1e-4f);
  for (int64_t t = 10; t < 110; ++t) EXPECT_LE(s.at(t + 1), s.at(t)) << t;
}

TEST(LrSchedule, Constant) {
  LrSchedule s;
  s.max_lr = 2e-3f;
  s.min_lr = 0;
  s.warmup_steps = 4;
  s.total_steps = 10;
  s.decay = LrDecay::constant;
  EXPECT_FLOAT_EQ(s.at(1), 1e-3f);
  EXPECT_FLOAT_EQ(s.at(3), 2e-3f);
  EXPECT_FLOAT_EQ(s.at(7), 2e-3f);
  EXPECT_FLOAT_EQ(s.at(20), 2e-3f);
  s.warmup_steps = 0;
  EXPECT_FLOAT_EQ(s.at(0), 2e-3f);
  EXPECT_EQ(parse_lr_decay("constant"), LrDecay::constant);
  EXPECT_THROW(parse_lr_decay("linear"), Error);
}

TEST(Clip, FactorAndNorm) {
  EXPECT_EQ(clip_factor(0.5, 1.0f), 1.0f);
  EXPECT_EQ(clip_factor(5.0, 0.0f), 1.0f);  // clipping off
  EXPECT_NEAR(clip_factor(4.0, 1.0f), 0.25f, 1e-6);
  EXPECT_EQ(clip_factor(std::nan(""), 1.0f), 1.0f);

  MemoryTracker tracker;
  cpu::CpuBackend ctx(2, tracker);
  Model model(tiny_llama(), Precision::fp32, ctx);
  fill_grads(model, 9);
  const float* g = model.flat_grad().data<float>();
  double ref = 0;
  for (int64_t i = 0; i < model.num_params(); ++i) ref += double(g[i]) * g[i];
  double norm = global_grad_norm(model);
  EXPECT_NEAR(norm, std::sqrt(ref), 1e-9 * std::sqrt(ref));
  EXPECT_EQ(norm, global_grad_norm(model));  // deterministic
}

}  // namespace
}  // namespace meshtrain
