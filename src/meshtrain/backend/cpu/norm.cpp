#include "meshtrain/backend/cpu/norm.h"

#include <cmath>
#include <vector>

#include "meshtrain/backend/cpu/simd.h"

namespace meshtrain::cpu {

namespace {

float sum_sq(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

float sum(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

}  // namespace

void rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y, float* rstd,
                     int64_t rows, int64_t dim, float eps) {
  simd::dispatch_store(out_dtype, y, [&](auto* out) {
#pragma omp parallel
    {
      std::vector<float> tmp(static_cast<size_t>(dim));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * dim;
        const float s = 1.0f / std::sqrt(sum_sq(xr, dim) / static_cast<float>(dim) + eps);
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) tmp[i] = xr[i] * s * w[i];
        simd::store_row(out + r * dim, tmp.data(), dim);
      }
    }
  });
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                      float* dw, int64_t rows, int64_t dim) {
  // xhat = x * s; dx = s * (g - xhat * mean(g * xhat)) with g = dy * w.
  simd::reduce_rows(
      rows, dim,
      [&](int64_t r, float* acc) {
        const float* xr = x + r * dim;
        const float* dyr = dy + r * dim;
        float* dxr = dx + r * dim;
        const float s = rstd[r];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; ++i) dot += dyr[i] * w[i] * xr[i];
        const float c = dot * s * s / static_cast<float>(dim);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) {
          dxr[i] += s * (dyr[i] * w[i] - xr[i] * c);
          acc[i] += dyr[i] * xr[i] * s;
        }
      },
      [&](int64_t j, float total) { dw[j] += total; });
}

void layernorm_forward(const float* x, const float* w, const float* b, DType out_dtype, void* y,
                       float* mean, float* rstd, int64_t rows, int64_t dim, float eps) {
  simd::dispatch_store(out_dtype, y, [&](auto* out) {
#pragma omp parallel
    {
      std::vector<float> tmp(static_cast<size_t>(dim));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * dim;
        const float m = sum(xr, dim) / static_cast<float>(dim);
        float var = 0.0f;
#pragma omp simd reduction(+ : var)
        for (int64_t i = 0; i < dim; ++i) var += (xr[i] - m) * (xr[i] - m);
        const float s = 1.0f / std::sqrt(var / static_cast<float>(dim) + eps);
        mean[r] = m;
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) tmp[i] = (xr[i] - m) * s * w[i] + b[i];
        simd::store_row(out + r * dim, tmp.data(), dim);
      }
    }
  });
}

void layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dw, float* db, int64_t rows, int64_t dim) {
  // dx = s * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w.
  simd::reduce_rows(
      rows, 2 * dim,
      [&](int64_t r, float* acc) {
        const float* xr = x + r * dim;
        const float* dyr = dy + r * dim;
        float* dxr = dx + r * dim;
        const float m = mean[r], s = rstd[r];
        float g_sum = 0.0f, gx_sum = 0.0f;
#pragma omp simd reduction(+ : g_sum, gx_sum)
        for (int64_t i = 0; i < dim; ++i) {
          const float g = dyr[i] * w[i];
          g_sum += g;
          gx_sum += g * (xr[i] - m) * s;
        }
        const float g_mean = g_sum / static_cast<float>(dim);
        const float gx_mean = gx_sum / static_cast<float>(dim);
        float* acc_w = acc;
        float* acc_b = acc + dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) {
          const float xhat = (xr[i] - m) * s;
          dxr[i] += s * (dyr[i] * w[i] - g_mean - xhat * gx_mean);
          acc_w[i] += dyr[i] * xhat;
          acc_b[i] += dyr[i];
        }
      },
      [&](int64_t j, float total) {
        if (j < dim) {
          dw[j] += total;
        } else {
          db[j - dim] += total;
        }
      });
}

}  // namespace meshtrain::cpu
