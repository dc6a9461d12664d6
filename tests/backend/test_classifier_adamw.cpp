// Fused classifier (logits + softmax cross-entropy + backward) and AdamW.
#include <cstring>

#include "meshtrain/backend/cpu/adamw.h"
#include "meshtrain/backend/cpu/cross_entropy.h"
#include "meshtrain/util/error.h"
#include "reference.h"

namespace meshtrain::testing {
namespace {

constexpr int64_t kRows = 7, kDim = 24, kVocab = 37;
const std::vector<int32_t> kTargets = {5, 0, 36, -1, 12, 5, 30};

// Sum over rows with target >= 0 of -log softmax(h w^T)[target], float64.
double loss_ref(const std::vector<double>& h, const std::vector<double>& w, std::vector<double>* rows) {
  double total = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    std::vector<double> z(kVocab);
    double mx = -1e300, sum = 0;
    for (int64_t v = 0; v < kVocab; ++v) {
      for (int64_t i = 0; i < kDim; ++i) z[v] += h[r * kDim + i] * w[v * kDim + i];
      mx = std::max(mx, z[v]);
    }
    for (double zv : z) sum += std::exp(zv - mx);
    const double l = kTargets[r] < 0 ? 0.0 : std::log(sum) + mx - z[kTargets[r]];
    if (rows) rows->push_back(l);
    total += l;
  }
  return total;
}

TEST(FusedClassifier, LossAndGradientCheckF32) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  auto h = random_floats(kRows * kDim, 120, -1, 1);
  auto w = random_floats(kVocab * kDim, 121, -1, 1);
  const float grad_scale = 0.25f;
  for (int64_t chunk : {0, 3, 7}) {
    SCOPED_TRACE(chunk);
    std::vector<float> dh(h.size(), 99.0f), dw(w.size(), 0.5f), rows(kRows);
    cpu::ClassifierArgs args{.rows = kRows, .dim = kDim, .vocab = kVocab, .h = h.data(), .w = w.data(),
                             .targets = kTargets.data(), .grad_scale = grad_scale, .dh = dh.data(),
                             .dw = dw.data(), .row_losses = rows.data(), .chunk_rows = chunk};
    const double loss = cpu::fused_classifier(ctx, args);
    std::vector<double> want_rows;
    const double want = loss_ref(to_double(h), to_double(w), &want_rows);
    EXPECT_NEAR(loss, want, 1e-5 * want);
    expect_close(rows, want_rows, 1e-5, 1e-6, "row_losses");
    auto gh = finite_difference(
        [&](const auto& v) { return grad_scale * loss_ref(v, to_double(w), nullptr); }, to_double(h));
    auto gw = finite_difference(
        [&](const auto& v) { return grad_scale * loss_ref(to_double(h), v, nullptr); }, to_double(w));
    for (auto& g : gw) g += 0.5;  // dw accumulates
    expect_close(dh, gh, 1e-4, 1e-5, "dh");
    expect_close(dw, gw, 1e-4, 1e-5, "dw");
    for (int64_t i = 0; i < kDim; ++i) EXPECT_EQ(dh[3 * kDim + i], 0.0f) << "ignored row";
  }
  // Forward only.
  cpu::ClassifierArgs args{.rows = kRows, .dim = kDim, .vocab = kVocab, .h = h.data(), .w = w.data(),
                           .targets = kTargets.data()};
  EXPECT_NEAR(cpu::fused_classifier(ctx, args), loss_ref(to_double(h), to_double(w), nullptr), 1e-4);
  std::vector<int32_t> bad = kTargets;
  bad[2] = kVocab;
  args.targets = bad.data();
  EXPECT_THROW(cpu::fused_classifier(ctx, args), Error);
}

TEST(FusedClassifier, Bf16) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  auto h = round_bf16(random_floats(kRows * kDim, 130, -1, 1));
  auto w = round_bf16(random_floats(kVocab * kDim, 131, -1, 1));
  auto h16 = to_bf16(h), w16 = to_bf16(w);
  std::vector<float> dh(h.size()), dw(w.size(), 0.0f);
  cpu::ClassifierArgs args{.rows = kRows, .dim = kDim, .vocab = kVocab, .compute = DType::bf16,
                           .h = h16.data(), .w = w16.data(), .targets = kTargets.data(),
                           .grad_scale = 1.0f, .dh = dh.data(), .dw = dw.data(), .chunk_rows = 4};
  // Inputs are exactly representable in bf16 and accumulation is f32: the loss is f32-accurate.
  const double want = loss_ref(to_double(h), to_double(w), nullptr);
  EXPECT_NEAR(cpu::fused_classifier(ctx, args), want, 1e-5 * want);
  auto gh = finite_difference([&](const auto& v) { return loss_ref(v, to_double(w), nullptr); }, to_double(h));
  auto gw = finite_difference([&](const auto& v) { return loss_ref(to_double(h), v, nullptr); }, to_double(w));
  // d_logits are rounded to bf16 for the two GEMMs.
  expect_close(dh, gh, 1e-2, 2e-3, "dh bf16");
  expect_close(dw, gw, 1e-2, 2e-3, "dw bf16");
}

// f16: the loss gradient's scale (fp16 loss scaling) goes into the f16
// d_logits; dividing the gradients by it gives the unscaled ones, and a scale
// too large for f16 overflows there to inf (what the loss scaler detects).
TEST(FusedClassifier, F16WithLossScale) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  auto h = round_f16(random_floats(kRows * kDim, 130, -1, 1));
  auto w = round_f16(random_floats(kVocab * kDim, 131, -1, 1));
  auto h16 = to_f16(h), w16 = to_f16(w);
  const float scale = 1024.0f;
  std::vector<float> dh(h.size()), dw(w.size(), 0.0f);
  cpu::ClassifierArgs args{.rows = kRows, .dim = kDim, .vocab = kVocab, .compute = DType::f16,
                           .h = h16.data(), .w = w16.data(), .targets = kTargets.data(),
                           .grad_scale = scale, .dh = dh.data(), .dw = dw.data(), .chunk_rows = 4};
  const double want = loss_ref(to_double(h), to_double(w), nullptr);
  EXPECT_NEAR(cpu::fused_classifier(ctx, args), want, 1e-5 * want);
  for (float& x : dh) x /= scale;
  for (float& x : dw) x /= scale;
  auto gh = finite_difference([&](const auto& v) { return loss_ref(v, to_double(w), nullptr); }, to_double(h));
  auto gw = finite_difference([&](const auto& v) { return loss_ref(to_double(h), v, nullptr); }, to_double(w));
  // d_logits rounded to f16 (8x finer than bf16).
  expect_close(dh, gh, 2e-3, 3e-4, "dh f16");
  expect_close(dw, gw, 2e-3, 3e-4, "dw f16");

  std::fill(dw.begin(), dw.end(), 0.0f);
  args.grad_scale = 1e6f;  // d_logits of the target overflow f16
  cpu::fused_classifier(ctx, args);
  bool overflow = false;
  for (float x : dh) overflow = overflow || !std::isfinite(x);
  EXPECT_TRUE(overflow);
}

TEST(AdamW, MatchesFloat64ReferenceOverSteps) {
  const int64_t n = 5003;
  auto p = random_floats(n, 140), g = random_floats(n, 141);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  std::vector<double> pd = to_double(p), md(n, 0.0), vd(n, 0.0);
  std::vector<bf16> compute(n);
  cpu::AdamWHyper hyper;
  hyper.lr = 1e-2f;
  hyper.weight_decay = 0.1f;
  hyper.grad_scale = 0.5f;
  for (int64_t step = 1; step <= 3; ++step) {
    hyper.step = step;
    cpu::adamw_update(hyper, p.data(), g.data(), m.data(), v.data(), compute.data(), n);
    const double b1 = hyper.beta1, b2 = hyper.beta2;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = static_cast<double>(g[i]) * hyper.grad_scale;
      md[i] = b1 * md[i] + (1 - b1) * gi;
      vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
      const double mh = md[i] / (1 - std::pow(b1, step)), vh = vd[i] / (1 - std::pow(b2, step));
      pd[i] -= static_cast<double>(hyper.lr) * (mh / (std::sqrt(vh) + hyper.eps) + hyper.weight_decay * pd[i]);
    }
  }
  expect_close(p, pd, 1e-5, 1e-6, "param");
  expect_close(m, md, 1e-5, 1e-6, "m");
  expect_close(v, vd, 1e-5, 1e-6, "v");
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(compute[i].bits, float_to_bf16(p[i]).bits) << i;
  // The f16 compute copy (fp16) is written the same way.
  std::vector<f16> half(n);
  cpu::adamw_update(hyper, p.data(), g.data(), m.data(), v.data(), half.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(half[i].bits, float_to_f16(p[i]).bits) << i;
}

TEST(SumSquares, ExactAndIndependentOfThreadCount) {
  // One partial block; 16 whole blocks (two groups a thread sums side by
  // side); 25 blocks and a partial one (the last group one block at a time).
  for (const int64_t n : {int64_t{100003}, int64_t{16} << 14, (int64_t{25} << 14) + 5}) {
    auto x = random_floats(n, 150);
    double want = 0;
    for (float xv : x) want += static_cast<double>(xv) * xv;
    double sums[3];
    for (int threads = 1; threads <= 3; ++threads) {
      ScopedThreads t(threads);
      sums[threads - 1] = cpu::sum_squares(x.data(), n);
    }
    EXPECT_NEAR(sums[0], want, 1e-12 * want) << n;
    EXPECT_EQ(std::memcmp(&sums[0], &sums[1], sizeof(double)), 0) << n;
    EXPECT_EQ(std::memcmp(&sums[0], &sums[2], sizeof(double)), 0) << n;
  }
  EXPECT_EQ(cpu::sum_squares(nullptr, 0), 0.0);
}

}  // namespace
}  // namespace meshtrain::testing
