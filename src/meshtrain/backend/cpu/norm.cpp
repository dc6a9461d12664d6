#include "meshtrain/backend/cpu/norm.h"

#include <cmath>
#include <vector>

#include "meshtrain/backend/cpu/activation.h"
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

// One row of RMSNorm's backward, n values with stat s: xhat = x * s, and
// d(input) = s * (g - xhat * mean(g * xhat)) with g = dy * w, added to dx
// (Add) or written to it; dw's terms added to acc. Pointers to locals, so the
// loops vectorise.
template <bool Add>
void rms_row_backward(const float* __restrict x, const float* __restrict dy,
                      const float* __restrict w, float s, int64_t n, float* __restrict dx,
                      float* __restrict acc) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < n; ++i) dot += dy[i] * w[i] * x[i];
  const float c = dot * s * s / static_cast<float>(n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = s * (dy[i] * w[i] - x[i] * c);
    dx[i] = Add ? dx[i] + g : g;
    acc[i] += dy[i] * x[i] * s;
  }
}

// The norms' forward over rows whose input `input(r)` gives: x's row, or the
// residual add's sum, written just before (so still in cache) when fused.
template <typename Input>
void rms_rows(Input input, const float* w, DType out_dtype, void* y, float* rstd, int64_t rows,
              int64_t dim, float eps) {
  simd::dispatch_store(out_dtype, y, [&](auto* out) {
#pragma omp parallel
    {
      std::vector<float> tmp(static_cast<size_t>(dim));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = dim;  // a local bound (not a captured reference) lets loops vectorise
        const float* __restrict xr = input(r);
        const float* __restrict wl = w;
        float* __restrict t = tmp.data();
        const float s = 1.0f / std::sqrt(sum_sq(xr, n) / static_cast<float>(n) + eps);
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) t[i] = xr[i] * s * wl[i];
        simd::store_row(out + r * n, t, n);
      }
    }
  });
}

template <typename Input>
void layer_rows(Input input, const float* w, const float* b, DType out_dtype, void* y,
                float* mean, float* rstd, int64_t rows, int64_t dim, float eps) {
  simd::dispatch_store(out_dtype, y, [&](auto* out) {
#pragma omp parallel
    {
      std::vector<float> tmp(static_cast<size_t>(dim));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = dim;
        const float* __restrict xr = input(r);
        const float* __restrict wl = w;
        const float* __restrict bl = b;
        float* __restrict t = tmp.data();
        const float m = sum(xr, n) / static_cast<float>(n);
        float var = 0.0f;
#pragma omp simd reduction(+ : var)
        for (int64_t i = 0; i < n; ++i) var += (xr[i] - m) * (xr[i] - m);
        const float s = 1.0f / std::sqrt(var / static_cast<float>(n) + eps);
        mean[r] = m;
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) t[i] = (xr[i] - m) * s * wl[i] + bl[i];
        simd::store_row(out + r * n, t, n);
      }
    }
  });
}

}  // namespace

void rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y, float* rstd,
                     int64_t rows, int64_t dim, float eps) {
  rms_rows([&](int64_t r) { return x + r * dim; }, w, out_dtype, y, rstd, rows, dim, eps);
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                      float* dw, int64_t rows, int64_t dim) {
  simd::reduce_rows(
      rows, dim,
      [&](int64_t r, float* acc) {
        rms_row_backward<true>(x + r * dim, dy + r * dim, w, rstd[r], dim, dx + r * dim, acc);
      },
      [&](int64_t j, float total) { dw[j] += total; });
}

void group_rmsnorm_forward(const ops::GroupNormDims& dims, float* x, const float* w, float* saved,
                           float* rstd) {
  const int64_t groups = dims.groups(), n = dims.width;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < dims.rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float* __restrict xg = x + r * dims.stride + g * n;
      float* __restrict sg = saved + r * dims.count + g * n;
      const float* __restrict wl = w;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sg[i] = xg[i];
      const float s = 1.0f / std::sqrt(sum_sq(sg, n) / static_cast<float>(n) + dims.eps);
      rstd[r * groups + g] = s;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) xg[i] = sg[i] * s * wl[i];
    }
  }
}

void group_rmsnorm_backward(const ops::GroupNormDims& dims, const float* saved, const float* w,
                            const float* rstd, DType grad_dtype, void* dy, float* dw) {
  const int64_t groups = dims.groups(), n = dims.width;
  simd::dispatch_store(grad_dtype, dy, [&](auto* d) {
    // Each (row, group) pair as one of rmsnorm_backward's rows.
    simd::reduce_rows(
        dims.rows * groups, n,
        [&](int64_t rg, float* acc) {
          // The group's d(output) widened to f32, and its d(input) before it is stored.
          thread_local std::vector<float> buffer;
          buffer.resize(static_cast<size_t>(2 * n));
          const int64_t r = rg / groups, g = rg % groups;
          auto* dg = d + r * dims.stride + g * n;
          simd::load_row(buffer.data(), dg, n);
          rms_row_backward<false>(saved + r * dims.count + g * n, buffer.data(), w, rstd[rg], n,
                                  buffer.data() + n, acc);
          simd::store_row(dg, buffer.data() + n, n);
        },
        [&](int64_t j, float total) { dw[j] += total; });
  });
}

void layernorm_forward(const float* x, const float* w, const float* b, DType out_dtype, void* y,
                       float* mean, float* rstd, int64_t rows, int64_t dim, float eps) {
  layer_rows([&](int64_t r) { return x + r * dim; }, w, b, out_dtype, y, mean, rstd, rows, dim,
             eps);
}

void residual_add_norm(const float* residual, const float* y, const float* bias, float* sum,
                       const ops::NormArgs& norm, DType out_dtype, void* out, int64_t rows,
                       int64_t dim) {
  auto input = [&](int64_t r) -> const float* {
    residual_add_row(residual + r * dim, y + r * dim, bias, sum + r * dim, dim);
    return sum + r * dim;
  };
  if (norm.layer_norm) {
    layer_rows(input, norm.w, norm.b, out_dtype, out, norm.mean, norm.rstd, rows, dim, norm.eps);
  } else {
    rms_rows(input, norm.w, out_dtype, out, norm.rstd, rows, dim, norm.eps);
  }
}

void layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dw, float* db, int64_t rows, int64_t dim) {
  // dx = s * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w.
  simd::reduce_rows(
      rows, 2 * dim,
      [&](int64_t r, float* __restrict acc) {
        const float* __restrict xr = x + r * dim;
        const float* __restrict dyr = dy + r * dim;
        const float* __restrict wl = w;
        float* __restrict dxr = dx + r * dim;
        const int64_t n = dim;
        const float m = mean[r], s = rstd[r];
        float g_sum = 0.0f, gx_sum = 0.0f;
#pragma omp simd reduction(+ : g_sum, gx_sum)
        for (int64_t i = 0; i < n; ++i) {
          const float g = dyr[i] * wl[i];
          g_sum += g;
          gx_sum += g * (xr[i] - m) * s;
        }
        const float g_mean = g_sum / static_cast<float>(n);
        const float gx_mean = gx_sum / static_cast<float>(n);
        float* __restrict acc_w = acc;
        float* __restrict acc_b = acc + n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float xhat = (xr[i] - m) * s;
          dxr[i] += s * (dyr[i] * wl[i] - g_mean - xhat * gx_mean);
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
