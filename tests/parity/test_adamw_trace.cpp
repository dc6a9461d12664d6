// (b) 20 AdamW steps (constant LR, weight decay by role, global-norm clipping)
// against torch.optim.AdamW. fp32 is compared with the float64 reference at
// 1e-5 relative per step for the loss, kFp32NormTol for the gradient norm: at
// gpt2's late steps (loss ~0.1) the norm measured 1.2e-5 off on an Intel Xeon
// VM with AMX (its f32 GEMM blocking), under 1e-5 on Zen 4. bf16 (bf16 matmul inputs, f32 master weights and
// state) is compared with the same float64 trace at kBf16Tol relative per step:
// PyTorch's own bf16 autocast run of the same steps deviates from float64 by up
// to ~1.2e-2 (gpt2, whose loss falls to 0.1 where relative error is largest),
// printed by the generator; meshtrain measured 1.4e-3 (llama) and 4.2e-3 (gpt2).
// The test prints both deviations.
#include <gtest/gtest.h>

#include "fixtures.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"

namespace meshtrain::parity {
namespace {

constexpr double kFp32Tol = 1e-5;
constexpr double kFp32NormTol = 5e-5;
constexpr double kBf16Tol = 2e-2;

struct Trace {
  std::vector<double> loss, grad_norm;
};

Trace run_steps(FixtureModel& f, const SafetensorsReader& ref) {
  Model& model = *f.model;
  auto num = [&](const char* key) { return std::stof(ref.metadata(key)); };
  AdamWConfig config;
  config.beta1 = num("beta1");
  config.beta2 = num("beta2");
  config.eps = num("eps");
  config.weight_decay = num("weight_decay");
  AdamW optimizer(model, config);
  const float lr = num("lr"), max_norm = num("max_grad_norm");

  const auto& shape = ref.info("train/tokens").shape;  // [steps, batch, seq + 1]
  const int64_t steps = shape[0], batch = shape[1], seq = shape[2] - 1, n = batch * seq;
  const auto all = ref.read_ints("train/tokens");
  Trace trace;
  std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < seq; ++t) {
        const int64_t base = (s * batch + b) * (seq + 1) + t;
        tokens[static_cast<size_t>(b * seq + t)] = static_cast<int32_t>(all[static_cast<size_t>(base)]);
        targets[static_cast<size_t>(b * seq + t)] = static_cast<int32_t>(all[static_cast<size_t>(base + 1)]);
      }
    }
    model.zero_grads();
    const double loss = model.forward_backward(tokens.data(), targets.data(), batch, seq,
                                               1.0f / static_cast<float>(n));
    const double norm = global_grad_norm(model);
    optimizer.step(lr, clip_factor(norm, max_norm));
    trace.loss.push_back(loss / static_cast<double>(n));
    trace.grad_norm.push_back(norm);
  }
  return trace;
}

std::vector<double> read_doubles(const SafetensorsReader& ref, const std::string& name,
                                 MemoryTracker& tracker) {
  Tensor t = ref.read_tensor(name, DType::f32, MemCategory::workspace, tracker);
  return std::vector<double>(t.data<float>(), t.data<float>() + t.numel());
}

double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return worst;
}

// A case's steps at one precision beside its reference file and float64 losses.
struct CaseRun {
  CaseRun(const std::string& case_name, Precision precision)
      : name(case_name),
        f(name, precision),
        ref(fixture_path(name + ".reference.safetensors")),
        trace(run_steps(f, ref)),
        ref_loss(read_doubles(ref, "train/loss_fp32", f.tracker)) {}
  std::string name;
  FixtureModel f;
  SafetensorsReader ref;
  Trace trace;
  std::vector<double> ref_loss;
};

class AdamWTrace : public ::testing::TestWithParam<const char*> {};

TEST_P(AdamWTrace, Fp32LossesMatchFloat64Reference) {
  CaseRun run(GetParam(), Precision::fp32);
  auto& [name, f, ref, trace, ref_loss] = run;
  const auto ref_norm = read_doubles(ref, "train/grad_norm", f.tracker);
  ASSERT_EQ(trace.loss.size(), ref_loss.size());
  for (size_t s = 0; s < ref_loss.size(); ++s) {
    EXPECT_LE(std::abs(trace.loss[s] - ref_loss[s]) / ref_loss[s], kFp32Tol)
        << "step " << s << ": loss " << trace.loss[s] << " vs " << ref_loss[s];
    EXPECT_LE(std::abs(trace.grad_norm[s] - ref_norm[s]) / ref_norm[s], kFp32NormTol)
        << "step " << s << ": grad norm " << trace.grad_norm[s] << " vs " << ref_norm[s];
  }
  std::printf("%s fp32: %zu steps, loss %.4f -> %.4f, max loss rel err %.2e, max grad-norm rel "
              "err %.2e\n", name.c_str(), ref_loss.size(), trace.loss.front(), trace.loss.back(),
              max_rel(trace.loss, ref_loss), max_rel(trace.grad_norm, ref_norm));
}

TEST_P(AdamWTrace, Bf16LossesWithinDocumentedTolerance) {
  CaseRun run(GetParam(), Precision::bf16);
  auto& [name, f, ref, trace, ref_loss] = run;
  const auto torch_bf16 = read_doubles(ref, "train/loss_bf16", f.tracker);
  for (size_t s = 0; s < ref_loss.size(); ++s) {
    EXPECT_LE(std::abs(trace.loss[s] - ref_loss[s]) / ref_loss[s], kBf16Tol)
        << "step " << s << ": loss " << trace.loss[s] << " vs " << ref_loss[s];
  }
  std::printf("%s bf16: max loss rel err vs float64 %.2e (PyTorch bf16 autocast: %.2e; "
              "tolerance %.0e)\n", name.c_str(), max_rel(trace.loss, ref_loss),
              max_rel(torch_bf16, ref_loss), kBf16Tol);
}

INSTANTIATE_TEST_SUITE_P(Families, AdamWTrace, ::testing::Values("llama_gqa", "gpt2"));

}  // namespace
}  // namespace meshtrain::parity
