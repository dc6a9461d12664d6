// Test helpers for the CPU kernels: random inputs, comparison with a float64
// reference, and central finite differences of a float64 function.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "meshtrain/tensor/dtype.h"

namespace meshtrain::testing {

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(gen);
  return out;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

inline std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

inline std::vector<float> from_bf16(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

// Rounds every value through bf16 (what a bf16 kernel actually sees).
inline std::vector<float> round_bf16(const std::vector<float>& v) { return from_bf16(to_bf16(v)); }

inline std::vector<f16> to_f16(const std::vector<float>& v) {
  std::vector<f16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_f16(v[i]);
  return out;
}

inline std::vector<float> from_f16(const std::vector<f16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f16_to_float(v[i]);
  return out;
}

inline std::vector<float> round_f16(const std::vector<float>& v) { return from_f16(to_f16(v)); }

// Every |got - want| <= rtol * |want| + atol * max|want|.
template <typename G>
void expect_close(const std::vector<G>& got, const std::vector<double>& want, double rtol,
                  double atol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  int reported = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    const double tol = rtol * std::abs(want[i]) + atol * scale;
    if (!(std::abs(g - want[i]) <= tol) && reported++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << want[i] << " (tol " << tol
                    << ", max|want| " << scale << ")";
  }
}

// Gradient of the scalar f at x by central differences (float64).
inline std::vector<double> finite_difference(const std::function<double(const std::vector<double>&)>& f,
                                             std::vector<double> x, double h = 1e-6) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double up = f(x);
    x[i] = x0 - h;
    const double down = f(x);
    x[i] = x0;
    grad[i] = (up - down) / (2.0 * h);
  }
  return grad;
}

// sum_i w[i] * y[i]: turns a vector output into the scalar a gradient check needs.
inline double weighted_sum(const std::vector<double>& y, const std::vector<float>& w) {
  double s = 0.0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
  return s;
}

// Sets the OpenMP thread count for a scope, restoring it afterwards.
class ScopedThreads {
 public:
  explicit ScopedThreads(int n);
  ~ScopedThreads();

 private:
  int saved_;
};

}  // namespace meshtrain::testing
