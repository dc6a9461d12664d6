// Training on the emulated CUDA device (tests/cuda_emu/emu.h): the model (dense,
// MoE, QLoRA), the optimizer and the clipping norm on the CUDA backend's kernels and host code,
// step by step against the same run on the CPU backend — what
// scripts/gpu_train_check.sh compares on a GPU, here with the CPU backend's
// GEMMs on both sides.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#define cuda cuda_emu
#include "meshtrain/backend/cuda/cuda_backend.h"
#undef cuda

#include "meshtrain/backend/registry.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "support/tiny_models.h"

namespace meshtrain {
namespace {

constexpr int kSteps = 6;
constexpr int64_t kRows = 3, kSeq = 12;

// Each step's loss and gradient norm. AdamW divides a gradient by its own
// scale, so a gradient off by a constant factor hardly moves the losses: the
// norms show it.
struct Trace {
  std::vector<double> losses, norms;
};

Trace train(Backend& backend, const ModelConfig& config, Precision precision,
            RecomputePolicy recompute) {
  Model model(config, precision, backend);
  model.set_recompute(recompute);
  model.init_weights(7);
  AdamW optimizer(model, AdamWConfig{});
  Trace trace;
  std::vector<int32_t> inputs, targets;
  const double tokens = static_cast<double>(kRows * kSeq);
  // One batch throughout: the loss must fall as the model fits it.
  testing::global_batch_rows(0, kRows, kSeq, config.vocab_size, 0, kRows, inputs, targets);
  for (int step = 0; step < kSteps; ++step) {
    model.zero_grads();
    trace.losses.push_back(model.forward_backward(inputs.data(), targets.data(), kRows, kSeq,
                                                  static_cast<float>(1.0 / tokens)) /
                           tokens);
    trace.norms.push_back(global_grad_norm(model));
    optimizer.step(1e-2f, clip_factor(trace.norms.back(), 1.0f));
  }
  return trace;
}

struct Case {
  std::string name;
  ModelConfig config;
  Precision precision;
  RecomputePolicy recompute;
  // Attention on cuDNN's stand-in (sdpa_emu.h), which rounds at other points
  // than the CPU backend's kernels: its gradients differ in the fourth digit
  // (3.9e-4 in the first norm), and AdamW at lr 1e-2 on one batch amplifies
  // that (5% in a norm by step 3). So step 0 is held to 1e-3 and the later
  // losses to 2e-2; wrong gradients miss step 0's bound by far.
  bool other_rounding = false;
};

std::vector<Case> cases() {
  ModelConfig moe = testing::tiny_llama(false);
  moe.moe.experts = 4;
  moe.moe.top_k = 2;
  moe.moe.hidden_dim = 12;
  ModelConfig window = testing::tiny_llama(true);
  window.sliding_window = 5;
  // Head width 8: bf16 attention takes the cuDNN path (its stand-in here, sdpa_emu.h).
  ModelConfig fused = testing::tiny_llama(false);
  fused.n_heads = 2;
  fused.n_kv_heads = 1;
  ModelConfig fused_window = fused;
  fused_window.sliding_window = 5;
  ModelConfig qlora = testing::tiny_llama(false);
  qlora.lora.rank = 4;
  qlora.lora.targets = {"q_proj", "v_proj", "down_proj"};
  qlora.lora.quantize_base = BaseQuant::nf4;
  return {
      {"llama fp32", testing::tiny_llama(false), Precision::fp32, {}},
      {"llama bf16", testing::tiny_llama(false), Precision::bf16, {}},
      {"llama fp32, full recompute", testing::tiny_llama(true), Precision::fp32,
       {Recompute::full, 0}},
      {"llama fp32, selective recompute, window 5", window, Precision::fp32,
       {Recompute::selective, 0}},
      {"gpt2 fp32", testing::tiny_gpt2(), Precision::fp32, {}},
      {"llama MoE fp32 (4 experts, top 2)", moe, Precision::fp32, {}},
      {"llama QLoRA bf16 (NF4 base, rank 4)", qlora, Precision::bf16, {}},
      {"llama bf16, head_dim 8 (fused attention)", fused, Precision::bf16, {}, true},
      {"llama bf16, head_dim 8 (fused attention), full recompute, window 5", fused_window,
       Precision::bf16, {Recompute::full, 0}, true},
  };
}

TEST(CudaEmu, TrainingEqualsTheCpuBackendStepByStep) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    c.config.validate();
    MemoryTracker emulated_tracker, cpu_tracker;
    cuda_emu::CudaBackend emulated(emulated_tracker);
    const auto cpu = make_backend("cpu", 1, cpu_tracker);
    const Trace want = train(*cpu, c.config, c.precision, c.recompute);
    const Trace got = train(emulated, c.config, c.precision, c.recompute);
    // Sums in another order (and bf16 rounding on top): as gpu_train_check.sh's tolerances.
    const double tol = c.precision == Precision::fp32 ? 1e-4 : 1e-2;
    for (size_t s = 0; s < kSteps; ++s) {
      const bool loose = c.other_rounding && s > 0;
      const double loss_tol = c.other_rounding ? (s == 0 ? 1e-3 : 2e-2) : tol;
      EXPECT_NEAR(got.losses[s], want.losses[s], loss_tol * std::fabs(want.losses[s]))
          << "step " << s;
      if (loose) continue;
      EXPECT_NEAR(got.norms[s], want.norms[s], (c.other_rounding ? 1e-3 : tol) * want.norms[s])
          << "step " << s;
    }
    EXPECT_LT(want.losses.back(), want.losses.front());  // it trains
  }
}

}  // namespace
}  // namespace meshtrain
