// RMSNorm, LayerNorm and QK-norm's group RMSNorm: a block of kThreads per row
// (or row group) for the row statistics and d(input); the weight gradients
// one thread per column over the rows in order.
#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

// A norm's input rows: x, or (fused with the residual add) residual + (y +
// bias), written to `sum` by the pass that first reads it. Each thread reads
// back only what it wrote, so the later passes need no barrier.
struct RowInput {
  const float* x = nullptr;
  const float* residual = nullptr;
  const float* y = nullptr;
  const float* bias = nullptr;
  float* sum = nullptr;  // fused when given
  __device__ const float* row(int64_t r, int64_t dim) const {
    return (sum != nullptr ? sum : x) + r * dim;
  }
  // Value i of row r in the first pass over it.
  __device__ float first(int64_t r, int64_t dim, int64_t i) const {
    const int64_t at = r * dim + i;
    if (sum == nullptr) return x[at];
    const float v = math::residual_sum(residual[at], y[at], bias, i);
    sum[at] = v;
    return v;
  }
};

template <typename E>
__global__ void rmsnorm_forward_kernel(RowInput in, const float* w, typename E::T* y, float* rstd,
                                       int64_t dim, float eps) {
  __shared__ float scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  float sq = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float v = in.first(r, dim, i);
    sq += v * v;
  }
  const float* xr = in.row(r, dim);
  const float s = math::inverse_rms(block_sum(sq, scratch), dim, eps);
  if (threadIdx.x == 0) rstd[r] = s;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) y[r * dim + i] = E::store(xr[i] * s * w[i]);
}

// d(input) of one row of n values with stat s (backend/cpu/norm.cpp's
// rms_row_backward): s (dy w - x c), c = s^2 mean(dy w x).
__device__ void rms_row_backward(const float* x, const float* dy, const float* w, float s,
                                 int64_t n, float* dx, bool add, float* scratch) {
  float dot = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) dot += dy[i] * w[i] * x[i];
  const float c = block_sum(dot, scratch) * s * s / static_cast<float>(n);
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float g = s * (dy[i] * w[i] - x[i] * c);
    dx[i] = add ? dx[i] + g : g;
  }
}

__global__ void rmsnorm_backward_kernel(const float* x, const float* w, const float* rstd,
                                        const float* dy, float* dx, int64_t dim) {
  __shared__ float scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  rms_row_backward(x + r * dim, dy + r * dim, w, rstd[r], dim, dx + r * dim, true, scratch);
}

// dw[j] += sum over rows of dy[r, j] x[r, j] rstd[r], rows in order.
__global__ void rms_weight_grad_kernel(const float* x, const float* rstd, const float* dy,
                                       float* dw, int64_t rows, int64_t dim) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float total = 0.0f;
  for (int64_t r = 0; r < rows; ++r) total += dy[r * dim + j] * x[r * dim + j] * rstd[r];
  dw[j] += total;
}

template <typename E>
__global__ void layernorm_forward_kernel(RowInput in, const float* w, const float* b,
                                         typename E::T* y, float* mean, float* rstd, int64_t dim,
                                         float eps) {
  __shared__ float scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += in.first(r, dim, i);
  const float* xr = in.row(r, dim);
  const float m = block_sum(sum, scratch) / static_cast<float>(dim);
  float var = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) var += (xr[i] - m) * (xr[i] - m);
  const float s = math::inverse_rms(block_sum(var, scratch), dim, eps);
  if (threadIdx.x == 0) {
    mean[r] = m;
    rstd[r] = s;
  }
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    y[r * dim + i] = E::store((xr[i] - m) * s * w[i] + b[i]);
  }
}

// dx += s (dy w - mean(dy w) - xhat mean(dy w xhat)).
__global__ void layernorm_backward_kernel(const float* x, const float* w, const float* mean,
                                          const float* rstd, const float* dy, float* dx,
                                          int64_t dim) {
  __shared__ float scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  const float* dyr = dy + r * dim;
  const float m = mean[r], s = rstd[r];
  float g_sum = 0.0f, gx_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float g = dyr[i] * w[i];
    g_sum += g;
    gx_sum += g * (xr[i] - m) * s;
  }
  const float g_mean = block_sum(g_sum, scratch) / static_cast<float>(dim);
  const float gx_mean = block_sum(gx_sum, scratch) / static_cast<float>(dim);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float xhat = (xr[i] - m) * s;
    dx[r * dim + i] += s * (dyr[i] * w[i] - g_mean - xhat * gx_mean);
  }
}

__global__ void layernorm_param_grad_kernel(const float* x, const float* mean, const float* rstd,
                                            const float* dy, float* dw, float* db, int64_t rows,
                                            int64_t dim) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float tw = 0.0f, tb = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float d = dy[r * dim + j];
    tw += d * ((x[r * dim + j] - mean[r]) * rstd[r]);
    tb += d;
  }
  dw[j] += tw;
  db[j] += tb;
}

// One block per (row, group): the group saved, normalised in place.
__global__ void group_rmsnorm_forward_kernel(GroupNorm g, float* x, const float* w, float* saved,
                                             float* rstd) {
  __shared__ float scratch[kThreads / 32];
  const int64_t groups = g.count / g.width, rg = blockIdx.x;
  const int64_t r = rg / groups, k = rg % groups;
  float* xg = x + r * g.stride + k * g.width;
  float* sg = saved + r * g.count + k * g.width;
  float sq = 0.0f;
  for (int64_t i = threadIdx.x; i < g.width; i += kThreads) {
    sg[i] = xg[i];
    sq += xg[i] * xg[i];
  }
  const float s = math::inverse_rms(block_sum(sq, scratch), g.width, g.eps);
  if (threadIdx.x == 0) rstd[rg] = s;
  for (int64_t i = threadIdx.x; i < g.width; i += kThreads) xg[i] = sg[i] * s * w[i];
}

// dw[j] += sum over (row, group) of dy x s, before dy is replaced.
template <typename E>
__global__ void group_weight_grad_kernel(GroupNorm g, const float* saved, const float* rstd,
                                         const typename E::T* dy, float* dw) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= g.width) return;
  const int64_t groups = g.count / g.width;
  float total = 0.0f;
  for (int64_t rg = 0; rg < g.rows * groups; ++rg) {
    const int64_t r = rg / groups, k = rg % groups;
    total += E::load(dy[r * g.stride + k * g.width + j]) * saved[r * g.count + k * g.width + j] *
             rstd[rg];
  }
  dw[j] += total;
}

// dy (E, strided like x) replaced by d(input); the group widened to f32 in
// dynamic shared memory first.
template <typename E>
__global__ void group_rmsnorm_backward_kernel(GroupNorm g, const float* saved, const float* w,
                                              const float* rstd, typename E::T* dy) {
  __shared__ float scratch[kThreads / 32];
  extern __shared__ float buffer[];  // [2 * width]
  const int64_t groups = g.count / g.width, rg = blockIdx.x;
  const int64_t r = rg / groups, k = rg % groups;
  typename E::T* dg = dy + r * g.stride + k * g.width;
  for (int64_t i = threadIdx.x; i < g.width; i += kThreads) buffer[i] = E::load(dg[i]);
  __syncthreads();
  rms_row_backward(saved + r * g.count + k * g.width, buffer, w, rstd[rg], g.width,
                   buffer + g.width, false, scratch);
  for (int64_t i = threadIdx.x; i < g.width; i += kThreads) dg[i] = E::store(buffer[g.width + i]);
}

unsigned rows_grid(int64_t rows) { return static_cast<unsigned>(rows); }

void rms_forward(cudaStream_t s, const RowInput& in, const float* w, Elem out_dtype, void* y,
                 float* rstd, int64_t rows, int64_t dim, float eps) {
  if (rows == 0) return;
  with_elem(out_dtype, [&](auto e) {
    using E = decltype(e);
    rmsnorm_forward_kernel<E><<<rows_grid(rows), kThreads, 0, s>>>(
        in, w, static_cast<typename E::T*>(y), rstd, dim, eps);
  });
}

void layer_forward(cudaStream_t s, const RowInput& in, const float* w, const float* b,
                   Elem out_dtype, void* y, float* mean, float* rstd, int64_t rows, int64_t dim,
                   float eps) {
  if (rows == 0) return;
  with_elem(out_dtype, [&](auto e) {
    using E = decltype(e);
    layernorm_forward_kernel<E><<<rows_grid(rows), kThreads, 0, s>>>(
        in, w, b, static_cast<typename E::T*>(y), mean, rstd, dim, eps);
  });
}

}  // namespace

void launch_rmsnorm_forward(cudaStream_t s, const float* x, const float* w, Elem out_dtype,
                            void* y, float* rstd, int64_t rows, int64_t dim, float eps) {
  rms_forward(s, RowInput{.x = x}, w, out_dtype, y, rstd, rows, dim, eps);
  check_launch("rmsnorm_forward");
}

void launch_rmsnorm_backward(cudaStream_t s, const float* x, const float* w, const float* rstd,
                             const float* dy, float* dx, float* dw, int64_t rows, int64_t dim) {
  if (rows == 0) return;
  rms_weight_grad_kernel<<<blocks_for(dim), kThreads, 0, s>>>(x, rstd, dy, dw, rows, dim);
  rmsnorm_backward_kernel<<<rows_grid(rows), kThreads, 0, s>>>(x, w, rstd, dy, dx, dim);
  check_launch("rmsnorm_backward");
}

void launch_layernorm_forward(cudaStream_t s, const float* x, const float* w, const float* b,
                              Elem out_dtype, void* y, float* mean, float* rstd, int64_t rows,
                              int64_t dim, float eps) {
  layer_forward(s, RowInput{.x = x}, w, b, out_dtype, y, mean, rstd, rows, dim, eps);
  check_launch("layernorm_forward");
}

void launch_residual_add_norm(cudaStream_t s, const ResidualNorm& a, Elem out_dtype, void* out,
                              int64_t rows, int64_t dim) {
  const RowInput in{.residual = a.residual, .y = a.y, .bias = a.bias, .sum = a.sum};
  if (a.layer_norm) {
    layer_forward(s, in, a.w, a.b, out_dtype, out, a.mean, a.rstd, rows, dim, a.eps);
  } else {
    rms_forward(s, in, a.w, out_dtype, out, a.rstd, rows, dim, a.eps);
  }
  check_launch("residual_add_norm");
}

void launch_layernorm_backward(cudaStream_t s, const float* x, const float* w, const float* mean,
                               const float* rstd, const float* dy, float* dx, float* dw,
                               float* db, int64_t rows, int64_t dim) {
  if (rows == 0) return;
  layernorm_param_grad_kernel<<<blocks_for(dim), kThreads, 0, s>>>(x, mean, rstd, dy, dw, db,
                                                                   rows, dim);
  layernorm_backward_kernel<<<rows_grid(rows), kThreads, 0, s>>>(x, w, mean, rstd, dy, dx, dim);
  check_launch("layernorm_backward");
}

void launch_group_rmsnorm_forward(cudaStream_t s, const GroupNorm& g, float* x, const float* w,
                                  float* saved, float* rstd) {
  const int64_t groups = g.rows * (g.count / g.width);
  if (groups == 0) return;
  group_rmsnorm_forward_kernel<<<rows_grid(groups), kThreads, 0, s>>>(g, x, w, saved, rstd);
  check_launch("group_rmsnorm_forward");
}

void launch_group_rmsnorm_backward(cudaStream_t s, const GroupNorm& g, const float* saved,
                                   const float* w, const float* rstd, Elem grad_dtype, void* dy,
                                   float* dw) {
  const int64_t groups = g.rows * (g.count / g.width);
  if (groups == 0) return;
  const size_t shared = 2 * static_cast<size_t>(g.width) * sizeof(float);
  with_elem(grad_dtype, [&](auto e) {
    using E = decltype(e);
    auto* d = static_cast<typename E::T*>(dy);
    group_weight_grad_kernel<E><<<blocks_for(g.width), kThreads, 0, s>>>(g, saved, rstd, d, dw);
    group_rmsnorm_backward_kernel<E><<<rows_grid(groups), kThreads, shared, s>>>(g, saved, w, rstd,
                                                                                 d);
  });
  check_launch("group_rmsnorm_backward");
}

}  // namespace meshtrain::cuda
