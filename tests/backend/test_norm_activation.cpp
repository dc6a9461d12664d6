// Norms, activations and embeddings: forward against float64 loops, backward
// against central finite differences of the float64 forward.
#include <cstring>

#include "meshtrain/backend/cpu/activation.h"
#include "meshtrain/backend/cpu/embedding.h"
#include "meshtrain/backend/cpu/norm.h"
#include "reference.h"

namespace meshtrain::testing {
namespace {

constexpr int64_t kRows = 7, kDim = 24;
constexpr float kEps = 1e-5f;

std::vector<double> rmsnorm_ref(const std::vector<double>& x, const std::vector<double>& w) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < kRows; ++r) {
    double ms = 0;
    for (int64_t i = 0; i < kDim; ++i) ms += x[r * kDim + i] * x[r * kDim + i];
    const double s = 1.0 / std::sqrt(ms / kDim + kEps);
    for (int64_t i = 0; i < kDim; ++i) y[r * kDim + i] = x[r * kDim + i] * s * w[i];
  }
  return y;
}

std::vector<double> layernorm_ref(const std::vector<double>& x, const std::vector<double>& w,
                                  const std::vector<double>& b) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < kRows; ++r) {
    double m = 0, v = 0;
    for (int64_t i = 0; i < kDim; ++i) m += x[r * kDim + i];
    m /= kDim;
    for (int64_t i = 0; i < kDim; ++i) v += (x[r * kDim + i] - m) * (x[r * kDim + i] - m);
    const double s = 1.0 / std::sqrt(v / kDim + kEps);
    for (int64_t i = 0; i < kDim; ++i) y[r * kDim + i] = (x[r * kDim + i] - m) * s * w[i] + b[i];
  }
  return y;
}

TEST(RmsNorm, ForwardAndGradientCheck) {
  auto x = random_floats(kRows * kDim, 10, -2, 2);
  auto w = random_floats(kDim, 11, 0.5, 1.5);
  auto dy = random_floats(kRows * kDim, 12);
  std::vector<float> y(x.size()), rstd(kRows);
  cpu::rmsnorm_forward(x.data(), w.data(), DType::f32, y.data(), rstd.data(), kRows, kDim, kEps);
  expect_close(y, rmsnorm_ref(to_double(x), to_double(w)), 1e-5, 1e-6, "y");

  std::vector<bf16> y16(x.size());
  std::vector<float> rstd16(kRows);
  cpu::rmsnorm_forward(x.data(), w.data(), DType::bf16, y16.data(), rstd16.data(), kRows, kDim, kEps);
  expect_close(from_bf16(y16), rmsnorm_ref(to_double(x), to_double(w)), 8e-3, 1e-5, "y bf16");

  // Backward adds into dx and dw: start from non-zero values.
  std::vector<float> dx(x.size(), 0.5f), dw(kDim, -0.25f);
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), kRows, kDim);
  auto gx = finite_difference(
      [&](const std::vector<double>& xv) { return weighted_sum(rmsnorm_ref(xv, to_double(w)), dy); },
      to_double(x));
  auto gw = finite_difference(
      [&](const std::vector<double>& wv) { return weighted_sum(rmsnorm_ref(to_double(x), wv), dy); },
      to_double(w));
  for (auto& g : gx) g += 0.5;
  for (auto& g : gw) g -= 0.25;
  expect_close(dx, gx, 1e-4, 1e-5, "dx");
  expect_close(dw, gw, 1e-4, 1e-5, "dw");
}

TEST(LayerNorm, ForwardAndGradientCheck) {
  auto x = random_floats(kRows * kDim, 20, -2, 2);
  auto w = random_floats(kDim, 21, 0.5, 1.5);
  auto b = random_floats(kDim, 22);
  auto dy = random_floats(kRows * kDim, 23);
  std::vector<float> y(x.size()), mean(kRows), rstd(kRows);
  cpu::layernorm_forward(x.data(), w.data(), b.data(), DType::f32, y.data(), mean.data(), rstd.data(),
                         kRows, kDim, kEps);
  auto want = layernorm_ref(to_double(x), to_double(w), to_double(b));
  expect_close(y, want, 1e-5, 1e-6, "y");
  std::vector<bf16> y16(x.size());
  cpu::layernorm_forward(x.data(), w.data(), b.data(), DType::bf16, y16.data(), mean.data(),
                         rstd.data(), kRows, kDim, kEps);
  expect_close(from_bf16(y16), want, 8e-3, 1e-5, "y bf16");

  std::vector<float> dx(x.size(), 0.5f), dw(kDim, 0.0f), db(kDim, 1.0f);
  cpu::layernorm_backward(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), dx.data(),
                          dw.data(), db.data(), kRows, kDim);
  auto xd = to_double(x), wd = to_double(w), bd = to_double(b);
  auto gx = finite_difference([&](const auto& v) { return weighted_sum(layernorm_ref(v, wd, bd), dy); }, xd);
  auto gw = finite_difference([&](const auto& v) { return weighted_sum(layernorm_ref(xd, v, bd), dy); }, wd);
  auto gb = finite_difference([&](const auto& v) { return weighted_sum(layernorm_ref(xd, wd, v), dy); }, bd);
  for (auto& g : gx) g += 0.5;
  for (auto& g : gb) g += 1.0;
  expect_close(dx, gx, 1e-4, 1e-5, "dx");
  expect_close(dw, gw, 1e-4, 1e-5, "dw");
  expect_close(db, gb, 1e-4, 1e-5, "db");
}

// hidden 37 exercises both the vector body and the tail.
constexpr int64_t kHidden = 37;

std::vector<double> swiglu_ref(const std::vector<double>& gu) {
  std::vector<double> out(kRows * kHidden);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kHidden; ++j) {
      const double g = gu[r * 2 * kHidden + j], u = gu[r * 2 * kHidden + kHidden + j];
      out[r * kHidden + j] = g / (1.0 + std::exp(-g)) * u;
    }
  return out;
}

std::vector<double> gelu_ref(const std::vector<double>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double u = std::sqrt(2.0 / M_PI) * (x[i] + 0.044715 * x[i] * x[i] * x[i]);
    y[i] = 0.5 * x[i] * (1.0 + std::tanh(u));
  }
  return y;
}

TEST(SwiGLU, ForwardAndGradientCheck) {
  auto gu = random_floats(kRows * 2 * kHidden, 30, -4, 4);
  auto dout = random_floats(kRows * kHidden, 31);
  std::vector<float> out(kRows * kHidden);
  cpu::swiglu_forward(gu.data(), DType::f32, out.data(), kRows, kHidden);
  auto want = swiglu_ref(to_double(gu));
  expect_close(out, want, 1e-5, 1e-6, "out");
  std::vector<bf16> out16(out.size());
  cpu::swiglu_forward(gu.data(), DType::bf16, out16.data(), kRows, kHidden);
  expect_close(from_bf16(out16), want, 8e-3, 1e-5, "out bf16");

  std::vector<float> dgu(gu.size(), 99.0f);  // overwritten
  cpu::swiglu_backward(gu.data(), dout.data(), DType::f32, dgu.data(), kRows, kHidden);
  auto g = finite_difference([&](const auto& v) { return weighted_sum(swiglu_ref(v), dout); }, to_double(gu));
  expect_close(dgu, g, 1e-4, 1e-5, "d_gate_up");
  std::vector<bf16> dgu16(gu.size());
  cpu::swiglu_backward(gu.data(), dout.data(), DType::bf16, dgu16.data(), kRows, kHidden);
  expect_close(from_bf16(dgu16), g, 8e-3, 1e-4, "d_gate_up bf16");
}

TEST(Gelu, ForwardAndGradientCheck) {
  const int64_t n = kRows * kHidden;
  auto x = random_floats(n, 40, -5, 5);
  x[0] = 0.0f;
  x[1] = 1e-4f;
  x[2] = -12.0f;
  auto dy = random_floats(n, 41);
  std::vector<float> y(n);
  cpu::gelu_forward(x.data(), DType::f32, y.data(), n);
  auto want = gelu_ref(to_double(x));
  expect_close(y, want, 1e-5, 1e-7, "y");
  std::vector<bf16> y16(n);
  cpu::gelu_forward(x.data(), DType::bf16, y16.data(), n);
  expect_close(from_bf16(y16), want, 8e-3, 1e-5, "y bf16");
  std::vector<float> dx(n, 99.0f);
  cpu::gelu_backward(x.data(), dy.data(), DType::f32, dx.data(), n);
  auto g = finite_difference([&](const auto& v) { return weighted_sum(gelu_ref(v), dy); }, to_double(x));
  expect_close(dx, g, 1e-4, 1e-5, "dx");
}

TEST(Residual, AddInplaceAndBiasBackward) {
  const int64_t n = kRows * kHidden;
  auto x = random_floats(n, 50), y = random_floats(n, 51);
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = static_cast<double>(x[i]) + y[i];
  cpu::add_inplace(x.data(), y.data(), n);
  expect_close(x, want, 1e-7, 0, "x");

  std::vector<float> db(kHidden, 1.0f);
  std::vector<double> wdb(kHidden, 1.0);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kHidden; ++j) wdb[j] += y[r * kHidden + j];
  cpu::bias_backward(y.data(), db.data(), kRows, kHidden);
  expect_close(db, wdb, 1e-6, 1e-7, "dbias");
}

TEST(Embedding, ForwardWithPositionsAndGradientCheck) {
  const int64_t B = 2, T = 5, V = 37, D = kDim, pos0 = 3;
  auto table = random_floats(V * D, 60);
  auto pos = random_floats((pos0 + T) * D, 61);
  std::vector<int32_t> ids = {3, 36, 0, 3, 17, 3, 5, 36, 9, 0};
  std::vector<float> out(B * T * D);
  cpu::embedding_forward({.batch = B, .seq = T, .dim = D, .pos0 = pos0}, table.data(), DType::f32,
                         pos.data(), ids.data(), out.data());
  auto ref = [&](const std::vector<double>& tab, const std::vector<double>& ps, int64_t p0 = 0) {
    std::vector<double> o(B * T * D);
    for (int64_t i = 0; i < B * T; ++i)
      for (int64_t j = 0; j < D; ++j) o[i * D + j] = tab[ids[i] * D + j] + ps[(p0 + i % T) * D + j];
    return o;
  };
  expect_close(out, ref(to_double(table), to_double(pos), pos0), 1e-7, 0, "out");

  // Gradient check, positions starting at 0 (the backward pass's convention).
  std::vector<float> out0(B * T * D);
  cpu::embedding_forward({.batch = B, .seq = T, .dim = D}, table.data(), DType::f32, pos.data(),
                         ids.data(), out0.data());
  auto dout = random_floats(B * T * D, 62);
  std::vector<float> dtab(V * D, 0.0f), dpos((pos0 + T) * D, 0.0f);
  cpu::embedding_backward({.batch = B, .seq = T, .dim = D}, ids.data(), dout.data(), dtab.data(),
                          dpos.data());
  auto gt = finite_difference([&](const auto& v) { return weighted_sum(ref(v, to_double(pos)), dout); },
                              to_double(table));
  auto gp = finite_difference([&](const auto& v) { return weighted_sum(ref(to_double(table), v), dout); },
                              to_double(pos));
  expect_close(dtab, gt, 1e-5, 1e-6, "dtable");
  expect_close(dpos, gp, 1e-5, 1e-6, "dpositions");
}

TEST(Embedding, BackwardIsBitIdenticalAcrossThreadCounts) {
  const int64_t B = 3, T = 64, V = 50, D = 200;
  std::vector<int32_t> ids(B * T);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7) % 5);  // heavy repeats
  auto dout = random_floats(B * T * D, 70);
  std::vector<float> t1(V * D, 0.0f), t2(V * D, 0.0f), p1(T * D, 0.0f), p2(T * D, 0.0f);
  {
    ScopedThreads one(1);
    cpu::embedding_backward({.batch = B, .seq = T, .dim = D}, ids.data(), dout.data(), t1.data(),
                            p1.data());
  }
  {
    ScopedThreads two(2);
    cpu::embedding_backward({.batch = B, .seq = T, .dim = D}, ids.data(), dout.data(), t2.data(),
                            p2.data());
  }
  EXPECT_EQ(std::memcmp(t1.data(), t2.data(), t1.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace meshtrain::testing
