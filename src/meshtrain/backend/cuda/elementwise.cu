// Elementwise kernels, column sums, AdamW and the sum of squares.
#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

template <typename From, typename To>
__global__ void convert_kernel(const typename From::T* src, typename To::T* dst, int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, n) dst[i] = To::store(From::load(src[i]));
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, n) x[i] += y[i];
}

__global__ void mul_kernel(float* x, const float* y, int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, n) x[i] *= y[i];
}

__global__ void add_product_kernel(float* x, const float* a, const float* b, int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, n) x[i] += a[i] * b[i];
}

__global__ void residual_add_kernel(const float* residual, const float* y, const float* bias,
                                    float* out, int64_t rows, int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, rows * n) {
    out[i] = math::residual_sum(residual[i], y[i], bias, i % n);
  }
}

// One thread per column, the rows in order.
__global__ void column_sum_kernel(const float* dy, float* dbias, int64_t rows, int64_t n) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float total = 0.0f;
  for (int64_t r = 0; r < rows; ++r) total += dy[r * n + j];
  dbias[j] += total;
}

template <typename E>
__global__ void swiglu_forward_kernel(const float* gate_up, typename E::T* out, int64_t rows,
                                      int64_t hidden) {
  MESHTRAIN_GRID_STRIDE(i, rows * hidden) {
    const int64_t r = i / hidden, j = i % hidden;
    const float* row = gate_up + r * 2 * hidden;
    out[i] = E::store(math::swiglu(row[j], row[hidden + j]));
  }
}

template <typename E>
__global__ void swiglu_backward_kernel(const float* gate_up, const float* d_out,
                                       typename E::T* d_gate_up, int64_t rows, int64_t hidden) {
  MESHTRAIN_GRID_STRIDE(i, rows * hidden) {
    const int64_t r = i / hidden, j = i % hidden;
    const float* row = gate_up + r * 2 * hidden;
    float dg, du;
    math::swiglu_backward(row[j], row[hidden + j], d_out[i], dg, du);
    d_gate_up[r * 2 * hidden + j] = E::store(dg);
    d_gate_up[r * 2 * hidden + hidden + j] = E::store(du);
  }
}

template <typename E>
__global__ void gelu_forward_kernel(const float* x, typename E::T* y, int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, n) y[i] = E::store(math::gelu(x[i]));
}

template <typename E>
__global__ void gelu_backward_kernel(const float* x, const float* dy, typename E::T* dx,
                                     int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, n) dx[i] = E::store(math::gelu_backward(x[i], dy[i]));
}

template <typename E>
__global__ void adamw_kernel(math::AdamWStep step, float* param, float* grad, bool clear_grad,
                             float* m, float* v, typename E::T* copy, int64_t n) {
  MESHTRAIN_GRID_STRIDE(i, n) {
    float p = param[i], mi = m[i], vi = v[i];
    math::adamw_update(step, p, grad[i], mi, vi);
    if (clear_grad) grad[i] = 0.0f;
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (copy != nullptr) copy[i] = E::store(p);
  }
}

// Each block sums its kSumChunk elements in double: thread t the elements t,
// t + kThreads, ... of the chunk, then the block's tree.
constexpr int64_t kSumChunk = int64_t{1} << 14;

__global__ void sum_squares_kernel(const float* x, int64_t n, double* partials) {
  __shared__ double scratch[kThreads / 32];
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kSumChunk;
  const int64_t i1 = i0 + kSumChunk < n ? i0 + kSumChunk : n;
  double s = 0.0;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += kThreads) {
    const double xi = x[i];
    s += xi * xi;
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(const double* partials, int64_t count, double* total) {
  __shared__ double scratch[kThreads / 32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) s += partials[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) *total = s;
}

}  // namespace

void launch_convert(cudaStream_t s, Elem from, const void* src, Elem to, void* dst, int64_t n) {
  with_elem(from, [&](auto f) {
    with_elem(to, [&](auto t) {
      using From = decltype(f);
      using To = decltype(t);
      convert_kernel<From, To><<<blocks_for(n), kThreads, 0, s>>>(
          static_cast<const typename From::T*>(src), static_cast<typename To::T*>(dst), n);
    });
  });
  check_launch("convert");
}

void launch_add_inplace(cudaStream_t s, float* x, const float* y, int64_t n) {
  add_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  check_launch("add_inplace");
}

void launch_mul_inplace(cudaStream_t s, float* x, const float* y, int64_t n) {
  mul_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  check_launch("mul_inplace");
}

void launch_add_product(cudaStream_t s, float* x, const float* a, const float* b, int64_t n) {
  add_product_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, a, b, n);
  check_launch("add_product");
}

void launch_residual_add(cudaStream_t s, const float* residual, const float* y, const float* bias,
                         float* out, int64_t rows, int64_t n) {
  residual_add_kernel<<<blocks_for(rows * n), kThreads, 0, s>>>(residual, y, bias, out, rows, n);
  check_launch("residual_add");
}

void launch_bias_backward(cudaStream_t s, const float* dy, float* dbias, int64_t rows, int64_t n) {
  column_sum_kernel<<<blocks_for(n), kThreads, 0, s>>>(dy, dbias, rows, n);
  check_launch("bias_backward");
}

void launch_swiglu_forward(cudaStream_t s, const float* gate_up, Elem out_dtype, void* out,
                           int64_t rows, int64_t hidden) {
  with_elem(out_dtype, [&](auto e) {
    using E = decltype(e);
    swiglu_forward_kernel<E><<<blocks_for(rows * hidden), kThreads, 0, s>>>(
        gate_up, static_cast<typename E::T*>(out), rows, hidden);
  });
  check_launch("swiglu_forward");
}

void launch_swiglu_backward(cudaStream_t s, const float* gate_up, const float* d_out,
                            Elem grad_dtype, void* d_gate_up, int64_t rows, int64_t hidden) {
  with_elem(grad_dtype, [&](auto e) {
    using E = decltype(e);
    swiglu_backward_kernel<E><<<blocks_for(rows * hidden), kThreads, 0, s>>>(
        gate_up, d_out, static_cast<typename E::T*>(d_gate_up), rows, hidden);
  });
  check_launch("swiglu_backward");
}

void launch_gelu_forward(cudaStream_t s, const float* x, Elem out_dtype, void* y, int64_t n) {
  with_elem(out_dtype, [&](auto e) {
    using E = decltype(e);
    gelu_forward_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(x, static_cast<typename E::T*>(y), n);
  });
  check_launch("gelu_forward");
}

void launch_gelu_backward(cudaStream_t s, const float* x, const float* dy, Elem grad_dtype,
                          void* dx, int64_t n) {
  with_elem(grad_dtype, [&](auto e) {
    using E = decltype(e);
    gelu_backward_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(x, dy,
                                                              static_cast<typename E::T*>(dx), n);
  });
  check_launch("gelu_backward");
}

void launch_adamw(cudaStream_t s, const math::AdamWStep& step, float* param, float* grad,
                  bool clear_grad, float* m, float* v, Elem copy_dtype, void* copy, int64_t n) {
  with_elem(copy_dtype, [&](auto e) {
    using E = decltype(e);
    adamw_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(step, param, grad, clear_grad, m, v,
                                                      static_cast<typename E::T*>(copy), n);
  });
  check_launch("adamw");
}

int64_t sum_squares_partials(int64_t n) { return n <= 0 ? 1 : (n + kSumChunk - 1) / kSumChunk; }

void launch_sum_squares(cudaStream_t s, const float* x, int64_t n, double* partials,
                        double* total) {
  const int64_t count = sum_squares_partials(n);
  if (n <= 0) {
    cudaMemsetAsync(partials, 0, sizeof(double), s);
  } else {
    sum_squares_kernel<<<static_cast<unsigned>(count), kThreads, 0, s>>>(x, n, partials);
  }
  sum_partials_kernel<<<1, kThreads, 0, s>>>(partials, count, total);
  check_launch("sum_squares");
}

}  // namespace meshtrain::cuda
