// The CUDA kernels' arithmetic (backend/cuda/math.h) run on the CPU, where
// CI runs: the 16-bit conversions bit for bit against tensor/dtype.h (every
// f16 value, a sweep of floats), the activations, RoPE, AdamW and the norm's
// scale against the CPU backend's kernels and float64, and the online softmax
// against float64. No GPU needed; what the device adds (its own exp, FMA contraction)
// is the ops suite's to bound on a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/backend/cuda/math.h"
#include "meshtrain/tensor/dtype.h"
#include "meshtrain/util/context_split.h"

namespace meshtrain::cuda {
namespace {

// Floats of every binade and sign, the boundaries of both 16-bit formats, ties.
std::vector<float> float_sweep() {
  std::vector<float> out;
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) out.push_back(math::bits_float(bits(rng)));
  for (uint32_t u = 0x33000000u; u < 0x38800000u; u += 0x1001u) out.push_back(math::bits_float(u));
  for (float f : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 65536.0f, 6.1035156e-5f,
                  5.9604645e-8f, 2.9802322e-8f, 2.9802326e-8f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()}) {
    out.push_back(f);
    out.push_back(-f);
  }
  return out;
}

TEST(CudaMath, Bf16RoundsAsTheHostConversion) {
  for (float f : float_sweep()) {
    ASSERT_EQ(math::bf16_from_float(f), float_to_bf16(f).bits) << f;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(math::bf16_to_float(math::bf16_from_float(nan))));
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float got = math::bf16_to_float(h), want = meshtrain::bf16_to_float(bf16{h});
    ASSERT_EQ(math::float_bits(got), math::float_bits(want)) << b;
  }
}

TEST(CudaMath, F16RoundsAsTheCompilersHalf) {
  for (float f : float_sweep()) {
    if (std::isnan(f)) {
      EXPECT_EQ(math::f16_from_float(f) & 0x7e00u, 0x7e00u);
      continue;
    }
    ASSERT_EQ(math::f16_from_float(f), float_to_f16(f).bits) << f << " (bits " << std::hex
                                                               << math::float_bits(f) << ")";
  }
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float got = math::f16_to_float(h), want = meshtrain::f16_to_float(f16{h});
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << b;
    } else {
      ASSERT_EQ(math::float_bits(got), math::float_bits(want)) << b;
    }
  }
}

std::vector<float> normal(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The CPU backend's result next to the device functions', element by element:
// they may differ by exp's last bits (the CPU's vector exp is its own).
TEST(CudaMath, ActivationsMatchTheCpuBackend) {
  MemoryTracker tracker;
  cpu::CpuBackend cpu(1, tracker);
  const int64_t rows = 3, hidden = 301;
  const std::vector<float> gate_up = normal(2 * rows * hidden, 2.0f, 1);
  const std::vector<float> d = normal(rows * hidden, 1.0f, 2);
  std::vector<float> out(rows * hidden), d_gate_up(2 * rows * hidden);
  cpu.swiglu_forward(gate_up.data(), DType::f32, out.data(), rows, hidden);
  cpu.swiglu_backward(gate_up.data(), d.data(), DType::f32, d_gate_up.data(), rows, hidden);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < hidden; ++j) {
      const float g = gate_up[r * 2 * hidden + j], u = gate_up[r * 2 * hidden + hidden + j];
      const int64_t i = r * hidden + j;
      EXPECT_NEAR(math::swiglu(g, u), out[i], 1e-6f * (1 + std::fabs(out[i])));
      float dg, du;
      math::swiglu_backward(g, u, d[i], dg, du);
      EXPECT_NEAR(dg, d_gate_up[r * 2 * hidden + j], 1e-6f * (1 + std::fabs(dg)));
      EXPECT_NEAR(du, d_gate_up[r * 2 * hidden + hidden + j], 1e-6f * (1 + std::fabs(du)));
    }
  }
  const std::vector<float> x = normal(1001, 3.0f, 3), dy = normal(x.size(), 1.0f, 11);
  std::vector<float> y(x.size()), dx(x.size());
  cpu.gelu_forward(x.data(), DType::f32, y.data(), static_cast<int64_t>(x.size()));
  cpu.gelu_backward(x.data(), dy.data(), DType::f32, dx.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    // float64 GELU (tanh form) as the reference of both.
    const double xi = x[i], u = 0.7978845608028654 * (xi + 0.044715 * xi * xi * xi);
    EXPECT_NEAR(math::gelu(x[i]), 0.5 * xi * (1 + std::tanh(u)), 2e-6 * (1 + std::fabs(xi)));
    EXPECT_NEAR(math::gelu(x[i]), y[i], 1e-6f * (1 + std::fabs(y[i])));
    EXPECT_NEAR(math::gelu_backward(x[i], dy[i]), dx[i], 1e-6f * (1 + std::fabs(dx[i])));
  }
}

// Within a few units in the last place: each compiler may fuse a product and
// a sum into one FMA (g++ in the CPU backend's vector code, nvcc on the device).
TEST(CudaMath, AdamWIsTheCpuBackendsUpdate) {
  MemoryTracker tracker;
  cpu::CpuBackend cpu(1, tracker);
  const size_t n = 1037;
  std::vector<float> p = normal(n, 1.0f, 4), g = normal(n, 0.1f, 5), m = normal(n, 0.01f, 6);
  std::vector<float> v = normal(n, 0.01f, 7);
  for (float& vi : v) vi = vi * vi;
  std::vector<float> p2 = p, m2 = m, v2 = v;
  const std::vector<float> p0 = p, m0 = m, v0 = v;
  ops::AdamWHyper hyper;
  hyper.lr = 3e-4f;
  hyper.weight_decay = 0.1f;
  hyper.step = 7;
  hyper.grad_scale = 0.5f;
  cpu.adamw_update(hyper, p.data(), g.data(), m.data(), v.data(), nullptr, static_cast<int64_t>(n));
  const math::AdamWStep step = math::adamw_step(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                                                hyper.weight_decay, hyper.step, hyper.grad_scale);
  for (size_t i = 0; i < n; ++i) {
    math::adamw_update(step, p2[i], g[i], m2[i], v2[i]);
    // A few rounding units of the terms each sum adds (m and v can cancel).
    const float gi = std::fabs(g[i] * hyper.grad_scale);
    ASSERT_NEAR(m2[i], m[i], 4e-7f * (std::fabs(m0[i]) + gi)) << i;
    ASSERT_NEAR(v2[i], v[i], 4e-7f * (v0[i] + gi * gi)) << i;
    ASSERT_NEAR(p2[i], p[i], 4e-7f * (std::fabs(p0[i]) + hyper.lr)) << i;
  }
}

TEST(CudaMath, RmsScaleIsTheCpuBackendsStatistic) {
  MemoryTracker tracker;
  cpu::CpuBackend cpu(1, tracker);
  const int64_t dim = 768;
  const std::vector<float> x = normal(dim, 1.5f, 8), w(dim, 1.0f);
  std::vector<float> y(dim);
  float rstd = 0;
  cpu.rmsnorm_forward(x.data(), w.data(), DType::f32, y.data(), &rstd, 1, dim, 1e-5f);
  double sq = 0;
  for (float xi : x) sq += static_cast<double>(xi) * xi;
  EXPECT_NEAR(math::inverse_rms(static_cast<float>(sq), dim, 1e-5f), rstd, 2e-6f * rstd);
  EXPECT_NEAR(rstd, 1.0 / std::sqrt(sq / dim + 1e-5), 1e-6 * rstd);
}

TEST(CudaMath, RopeRotatesAndItsInverseUndoes) {
  const std::vector<float> x = normal(64, 1.0f, 9);
  for (size_t i = 0; i + 1 < x.size(); i += 2) {
    const double angle = 0.37 * static_cast<double>(i + 1);
    const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    float a = x[i], b = x[i + 1];
    math::rope_rotate(a, b, c, s, false);
    EXPECT_NEAR(a, x[i] * std::cos(angle) - x[i + 1] * std::sin(angle), 1e-6);
    EXPECT_NEAR(b, x[i] * std::sin(angle) + x[i + 1] * std::cos(angle), 1e-6);
    math::rope_rotate(a, b, c, s, true);
    EXPECT_NEAR(a, x[i], 1e-6);
    EXPECT_NEAR(b, x[i + 1], 1e-6);
  }
}

TEST(CudaMath, OnlineSoftmaxIsTheLogSumExp) {
  const std::vector<float> x = normal(4000, 8.0f, 10);
  math::SoftmaxSum whole, left, right;
  double mx = -1e30;
  for (float xi : x) mx = std::max(mx, static_cast<double>(xi));
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    whole.add(x[i]);
    (i < 1234 ? left : right).add(x[i]);
    sum += std::exp(static_cast<double>(x[i]) - mx);
  }
  whole.add(-std::numeric_limits<float>::infinity());  // a masked entry adds nothing
  left.merge(right);
  const double lse = mx + std::log(sum);
  EXPECT_NEAR(whole.log_sum_exp(), lse, 1e-5 * std::fabs(lse));
  EXPECT_NEAR(left.log_sum_exp(), lse, 1e-5 * std::fabs(lse));
  math::SoftmaxSum empty;
  empty.merge(math::SoftmaxSum{});
  EXPECT_EQ(empty.sum, 0.0f);
}

TEST(CudaMath, ContextIndexIsTheSplitsGlobalIndex) {
  for (int64_t size : {1, 2, 3, 4, 8}) {
    const int64_t seq = 2 * size * 5;
    for (int64_t rank = 0; rank < size; ++rank) {
      const ContextSplit split{rank, size};
      for (int64_t i = 0; i < split.local(seq); ++i)
        EXPECT_EQ(math::context_global(seq, rank, size, i), split.global(seq, i))
            << "rank " << rank << " of " << size << ", token " << i;
    }
  }
}

// Ring attention's merge of a row's blocks: each block's exp-sum taken at the
// running max and the earlier sum rescaled gives the whole row's log-sum-exp.
TEST(CudaMath, RingRescaleMergesBlocksToTheRowsLogSumExp) {
  const std::vector<float> x = normal(3000, 6.0f, 11);
  double mx = -1e30;
  for (float xi : x) mx = std::max(mx, static_cast<double>(xi));
  double exact = 0;
  for (float xi : x) exact += std::exp(static_cast<double>(xi) - mx);
  float m = -std::numeric_limits<float>::infinity(), sum = 0;
  for (size_t b0 = 0; b0 < x.size(); b0 += 700) {
    const size_t b1 = std::min(x.size(), b0 + 700);
    float best = -std::numeric_limits<float>::infinity();
    for (size_t i = b0; i < b1; ++i) best = std::max(best, x[i]);
    const math::RingRescale r = math::ring_rescale(m, best);
    float total = 0;
    for (size_t i = b0; i < b1; ++i) total += std::exp(x[i] - r.max);
    sum = sum * r.alpha + total;
    m = r.max;
  }
  const double lse = mx + std::log(exact);
  EXPECT_NEAR(m + std::log(sum), lse, 1e-5 * std::fabs(lse));
  EXPECT_EQ(m, static_cast<float>(mx));
  EXPECT_EQ(math::ring_rescale(-std::numeric_limits<float>::infinity(), 2.0f).alpha, 0.0f);
}

}  // namespace
}  // namespace meshtrain::cuda
