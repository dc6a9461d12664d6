#include "meshtrain/backend/cpu/activation.h"

#include "meshtrain/backend/cpu/simd.h"

namespace meshtrain::cpu {

namespace {

// Elementwise kernels work on blocks small enough to stay in L1: exp into a
// stack buffer, then plain loops the compiler vectorises.
constexpr int64_t kBlock = 512;

// sig[i] = 1 / (1 + exp(-scale * x[i]))
void sigmoid_block(const float* x, float scale, float* sig, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) sig[i] = -scale * x[i];
  simd::exp_inplace(sig, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) sig[i] = 1.0f / (1.0f + sig[i]);
}

// GELU (tanh form): gelu(x) = x * sigmoid(2u), u = c0 * (x + c1 x^3),
// since 0.5 (1 + tanh(u)) = sigmoid(2u).
constexpr float kGeluC0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC1 = 0.044715f;

void gelu_inner(const float* x, float* two_u, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) two_u[i] = 2.0f * kGeluC0 * (x[i] + kGeluC1 * x[i] * x[i] * x[i]);
}

// Calls fn(out, r, j0, n) for every block [j0, j0 + n) of every row r of a
// [rows, hidden] output in dtype `dtype`, threaded over (row, block).
template <typename Fn>
void for_each_row_block(DType dtype, void* out, int64_t rows, int64_t hidden, Fn fn) {
  simd::dispatch_store(dtype, out, [&](auto* o) {
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j0 = 0; j0 < hidden; j0 += kBlock) fn(o, r, j0, std::min(kBlock, hidden - j0));
    }
  });
}

}  // namespace

void swiglu_forward(const float* gate_up, DType out_dtype, void* out, int64_t rows, int64_t hidden) {
  for_each_row_block(out_dtype, out, rows, hidden, [&](auto* o, int64_t r, int64_t j0, int64_t n) {
    const float* g = gate_up + r * 2 * hidden + j0;
    const float* u = g + hidden;
    float buf[kBlock];
    sigmoid_block(g, 1.0f, buf, n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = g[i] * buf[i] * u[i];
    simd::store_row(o + r * hidden + j0, buf, n);
  });
}

void swiglu_backward(const float* gate_up, const float* d_out, DType grad_dtype, void* d_gate_up,
                     int64_t rows, int64_t hidden) {
  // d_gate_up is [rows, 2 * hidden]: blocks of the gate half, each also writing its up half.
  for_each_row_block(grad_dtype, d_gate_up, rows, hidden, [&](auto* dgu, int64_t r, int64_t j0, int64_t n) {
    const float* g = gate_up + r * 2 * hidden + j0;
    const float* u = g + hidden;
    const float* d = d_out + r * hidden + j0;
    float sig[kBlock], dg[kBlock], du[kBlock];
    sigmoid_block(g, 1.0f, sig, n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      // silu'(g) = sig * (1 + g * (1 - sig))
      dg[i] = d[i] * u[i] * sig[i] * (1.0f + g[i] * (1.0f - sig[i]));
      du[i] = d[i] * g[i] * sig[i];
    }
    simd::store_row(dgu + r * 2 * hidden + j0, dg, n);
    simd::store_row(dgu + r * 2 * hidden + hidden + j0, du, n);
  });
}

void gelu_forward(const float* x, DType out_dtype, void* y, int64_t n) {
  simd::dispatch_store(out_dtype, y, [&](auto* out) {
#pragma omp parallel for schedule(static)
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t len = std::min(kBlock, n - i0);
      float buf[kBlock];
      gelu_inner(x + i0, buf, len);
      sigmoid_block(buf, 1.0f, buf, len);
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) buf[i] *= x[i0 + i];
      simd::store_row(out + i0, buf, len);
    }
  });
}

void gelu_backward(const float* x, const float* dy, DType grad_dtype, void* dx, int64_t n) {
  simd::dispatch_store(grad_dtype, dx, [&](auto* out) {
#pragma omp parallel for schedule(static)
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t len = std::min(kBlock, n - i0);
      const float* xs = x + i0;
      float buf[kBlock];
      gelu_inner(xs, buf, len);
      sigmoid_block(buf, 1.0f, buf, len);
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        // d/dx [x * sig(2u)] = sig + x * sig (1 - sig) * 2 du/dx
        const float s = buf[i];
        const float du = 2.0f * kGeluC0 * (1.0f + 3.0f * kGeluC1 * xs[i] * xs[i]);
        buf[i] = dy[i0 + i] * (s + xs[i] * s * (1.0f - s) * du);
      }
      simd::store_row(out + i0, buf, len);
    }
  });
}

void add_inplace(float* x, const float* y, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 4096)
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void mul_inplace(float* x, const float* y, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= y[i];
}

void add_product(float* x, const float* a, const float* b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] += a[i] * b[i];
}

void residual_add(const float* residual, const float* y, const float* bias, float* out,
                  int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    residual_add_row(residual + r * n, y + r * n, bias, out + r * n, n);
  }
}

void bias_backward(const float* dy, float* dbias, int64_t rows, int64_t n) {
  simd::reduce_rows(
      rows, n,
      [&](int64_t r, float* acc) {
        const float* d = dy + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) acc[j] += d[j];
      },
      [&](int64_t j, float total) { dbias[j] += total; });
}

}  // namespace meshtrain::cpu
