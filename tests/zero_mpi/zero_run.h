// A small explicit training loop for the ZeRO tests: the same global batches
// trained by a flat single-rank model + AdamW (the reference, on every rank
// alone) or by a ShardedDataParallel over the world (rank r takes rows
// [r*G/dp, (r+1)*G/dp) of each global batch of G rows).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/parallel/zero/sharded.h"
#include "support/tiny_models.h"

namespace meshtrain::testing {

struct ZeroRunSpec {
  ModelConfig model = tiny_llama(false);
  Precision precision = Precision::fp32;
  int steps = 12;
  int64_t global_rows = 24;  // divisible by 1, 2, 3, 4 ranks x 2 micro-batches
  int64_t seq = 8;
  int micro_batches = 1;     // per rank and step
  uint64_t seed = 7;
  float lr = 3e-3f, max_norm = 0.5f;
  RecomputePolicy recompute;  // activation checkpointing, the reference's too
};

struct ZeroRunResult {
  std::vector<double> losses, norms;
  std::vector<float> master, exp_avg, exp_avg_sq;  // flat layout; ZeRO: rank 0 only
  std::vector<zero::ZeroStepTiming> timings;
  // ZeRO: this rank's bytes by category right after construction and after
  // the last step (with the baseline of the bare external model removed).
  std::array<size_t, kMemCategories> built{}, trained{}, peak{};
};

inline AdamWConfig test_adamw() { return AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f}; }

// Rows [row0, row0 + rows) of step's global batch as inputs and targets.
inline void batch_rows(const ZeroRunSpec& s, int step, int64_t row0, int64_t rows,
                       std::vector<int32_t>& inputs, std::vector<int32_t>& targets) {
  global_batch_rows(step, s.global_rows, s.seq, s.model.vocab_size, row0, rows, inputs, targets);
}

inline ZeroRunResult run_reference(const ZeroRunSpec& s) {
  CpuModel m(s.model, s.precision, 1);
  m.model.set_recompute(s.recompute);
  m.model.init_weights(s.seed);
  AdamW optimizer(m.model, test_adamw());
  const auto tokens = static_cast<double>(s.global_rows * s.seq);
  ZeroRunResult r;
  std::vector<int32_t> in, tg;
  for (int step = 0; step < s.steps; ++step) {
    m.model.zero_grads();
    batch_rows(s, step, 0, s.global_rows, in, tg);
    const double loss = m.model.forward_backward(in.data(), tg.data(), s.global_rows, s.seq,
                                                 static_cast<float>(1.0 / tokens));
    const double norm = global_grad_norm(m.model);
    optimizer.step(s.lr, clip_factor(norm, s.max_norm));
    r.losses.push_back(loss / tokens);
    r.norms.push_back(norm);
  }
  auto copy = [](const Tensor& t) {
    return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
  };
  r.master = copy(m.model.flat_master());
  r.exp_avg = copy(optimizer.exp_avg());
  r.exp_avg_sq = copy(optimizer.exp_avg_sq());
  return r;
}

// A model in external storage with its own tracker and context, sharded by ZeRO.
struct ZeroModel {
  ZeroModel(const ZeroRunSpec& s, Communicator& dp, const zero::ZeroOptions& options)
      : ctx(1, tracker), model(s.model, s.precision, ctx, ParamStorage::external) {
    model.set_recompute(s.recompute);
    baseline = tracker.snapshot().live;
    zero = std::make_unique<zero::ShardedDataParallel>(model, dp, test_adamw(), options);
  }
  std::array<size_t, kMemCategories> live() const {
    std::array<size_t, kMemCategories> out = tracker.snapshot().live;
    for (size_t c = 0; c < kMemCategories; ++c) out[c] -= baseline[c];
    return out;
  }
  MemoryTracker tracker;
  cpu::CpuBackend ctx;
  Model model;
  std::array<size_t, kMemCategories> baseline{};
  std::unique_ptr<zero::ShardedDataParallel> zero;
};

// Trains `steps` steps from the state `z` is in (step_offset: the first step's index).
inline void train_zero(const ZeroRunSpec& s, ZeroModel& z, Communicator& dp, int step_offset,
                       int steps, ZeroRunResult& r) {
  const int64_t rows = s.global_rows / dp.size(), micro_rows = rows / s.micro_batches;
  const auto tokens = static_cast<double>(s.global_rows * s.seq);
  const auto grad_scale = static_cast<float>(static_cast<double>(dp.size()) / tokens);
  std::vector<int32_t> in, tg;
  for (int step = step_offset; step < step_offset + steps; ++step) {
    double loss = 0;
    for (int k = 0; k < s.micro_batches; ++k) {
      batch_rows(s, step, dp.rank() * rows + k * micro_rows, micro_rows, in, tg);
      z.zero->begin_micro_batch(k == 0, k + 1 == s.micro_batches);
      loss += z.model.forward_backward(in.data(), tg.data(), micro_rows, s.seq, grad_scale);
    }
    z.zero->finish_gradient_sync();
    dp.all_reduce(&loss, 1, CommDType::f64, ReduceOp::sum);
    const double norm = z.zero->grad_norm();
    z.zero->step(s.lr, clip_factor(norm, s.max_norm));
    r.losses.push_back(loss / tokens);
    r.norms.push_back(norm);
    r.timings.push_back(z.zero->last_step());
  }
}

inline std::vector<float> gather_state(ZeroModel& z, zero::ShardedDataParallel::State state,
                                       Communicator& dp) {
  std::vector<float> full(dp.rank() == 0 ? static_cast<size_t>(z.model.num_params()) : 0);
  z.zero->gather_full(state, 0, dp.rank() == 0 ? full.data() : nullptr);
  return full;
}

inline ZeroRunResult run_zero(const ZeroRunSpec& s, Communicator& dp,
                              const zero::ZeroOptions& options) {
  ZeroModel z(s, dp, options);
  ZeroRunResult r;
  r.built = z.live();
  z.zero->init_weights(s.seed);
  z.tracker.reset_peaks();
  train_zero(s, z, dp, 0, s.steps, r);
  z.zero->quiesce();
  r.trained = z.live();
  r.peak = z.tracker.snapshot().peak;
  using State = zero::ShardedDataParallel::State;
  r.master = gather_state(z, State::master, dp);
  r.exp_avg = gather_state(z, State::exp_avg, dp);
  r.exp_avg_sq = gather_state(z, State::exp_avg_sq, dp);
  return r;
}

// GPT-2's key bias has an exactly zero gradient (it adds the same q.b to a
// whole row of scores): its "gradient" is rounding noise, whose sign AdamW
// turns into steps of size lr. Those elements are left out of comparisons.
inline std::vector<bool> noise_elements(const ModelConfig& config) {
  std::vector<bool> out;
  for (const ParamSpec& p : build_param_specs(config)) {
    const bool key_bias = p.name.ends_with("attn.c_attn.bias");
    for (int64_t i = 0; i < p.numel(); ++i) {
      out.push_back(key_bias && i >= config.dim && i < 2 * config.dim);
    }
  }
  return out;
}

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b,
                          const std::vector<bool>& skip = {}) {
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (i < skip.size() && skip[i]) continue;
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

struct Tolerance {
  double loss = 1e-5, norm = 1e-5;  // relative
  float weight = 1e-5f;             // absolute
};

// Losses, gradient norms and final weights within tol.
inline void expect_close(const ZeroRunResult& got, const ZeroRunResult& want, const Tolerance& tol,
                         const std::string& what, const std::vector<bool>& skip = {}) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], tol.loss * std::fabs(want.losses[i]))
        << what << ": loss of step " << i + 1;
    EXPECT_NEAR(got.norms[i], want.norms[i], tol.norm * std::fabs(want.norms[i]))
        << what << ": grad norm of step " << i + 1;
  }
  if (!got.master.empty()) {
    EXPECT_LE(max_abs_diff(got.master, want.master, skip), tol.weight) << what << ": weights";
  }
}

inline void expect_identical(const ZeroRunResult& got, const ZeroRunResult& want,
                             const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_EQ(got.losses[i], want.losses[i]) << what << ": loss of step " << i + 1;
  }
  ASSERT_EQ(got.master.size(), want.master.size()) << what;
  for (auto [a, b] : {std::pair{&got.master, &want.master}, {&got.exp_avg, &want.exp_avg},
                      {&got.exp_avg_sq, &want.exp_avg_sq}}) {
    ASSERT_EQ(a->size(), b->size()) << what;
    if (a->empty()) continue;  // (memcmp of an empty vector's null data is undefined)
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->size() * sizeof(float)), 0) << what;
  }
}

}  // namespace meshtrain::testing
