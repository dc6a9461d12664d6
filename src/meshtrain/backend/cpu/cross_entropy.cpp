#include "meshtrain/backend/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/backend/cpu/onednn.h"
#include "meshtrain/backend/cpu/simd.h"
#include "meshtrain/util/error.h"

namespace meshtrain::cpu {

namespace {

// Rows per chunk: large enough that the dW GEMM (K = chunk) runs near peak and
// dW is swept few times, small enough that the logits chunk stays modest.
constexpr int64_t kDefaultChunkRows = 256;

int64_t chunk_rows(int64_t rows, int64_t requested) {
  return std::max<int64_t>(1, std::min(rows, requested > 0 ? requested : kDefaultChunkRows));
}

// The GEMMs of one chunk of n rows: logits, d(h), and d(W) or d(W)^T (accumulated).
MatmulDims logits_gemm(int64_t n, int64_t dim, int64_t V) { return {1, n, V, dim, false, true, false}; }
MatmulDims dh_gemm(int64_t n, int64_t dim, int64_t V) { return {1, n, dim, V, false, false, false}; }
MatmulDims dw_gemm(int64_t n, int64_t dim, int64_t V) { return {1, V, dim, n, true, false, false}; }
MatmulDims dw_t_gemm(int64_t n, int64_t dim, int64_t V) { return {1, dim, V, n, true, false, false}; }

// In f32, d(W) is accumulated transposed, dW^T += h^T · d_logits into a
// [dim, vocab] buffer, and added into dw once at the end: oneDNN 2.6 runs
// that GEMM 15–25% faster than dW += d_logits^T · h (A transposed along the
// vocabulary), and the whole classifier 5–8% faster (docs/benchmarks.md). In
// bf16 / f16 the whole classifier measured no faster, so the buffer is not
// worth its memory there.
bool transposed_dw(DType compute, bool trains_w) { return trains_w && compute == DType::f32; }

// dst[j, i] += src[i, j] for src [rows, cols]: tiles of 16 x 16 so both
// sides are read in cache lines; each dst element is written by one thread.
void add_transposed(const float* src, int64_t rows, int64_t cols, float* dst) {
  constexpr int64_t kTile = 16;
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
    const int64_t j1 = std::min(cols, j0 + kTile);
    for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
      const int64_t i1 = std::min(rows, i0 + kTile);
      for (int64_t j = j0; j < j1; ++j) {
        float* out = dst + j * rows;
        for (int64_t i = i0; i < i1; ++i) out[i] += src[i * cols + j];
      }
    }
  }
}

}  // namespace

double fused_classifier(CpuContext& ctx, const ClassifierArgs& args) {
  const int64_t rows = args.rows, dim = args.dim, V = args.vocab;
  const int64_t valid = args.vocab_valid < 0 ? V : args.vocab_valid;
  const int64_t total = args.vocab_total > 0 ? args.vocab_total : V, first = args.vocab_offset;
  // A slice may be all padding (a tiny vocabulary over many ranks).
  MESHTRAIN_CHECK(rows >= 0 && dim > 0 && V > 0 && valid <= V && first >= 0 &&
                      (valid == 0 || first + valid <= total),
                  "fused_classifier: bad dims rows={} dim={} vocab={} (valid {}, offset {}, total {})",
                  rows, dim, V, valid, first, total);
  for (int64_t r = 0; r < rows; ++r)
    MESHTRAIN_CHECK(args.targets[r] < total, "fused_classifier: target {} at row {} >= vocab {}",
                    args.targets[r], r, total);
  const int64_t chunk = chunk_rows(rows, args.chunk_rows);
  const bool backward = args.dh != nullptr || args.dw != nullptr;
  // Mixed precision: d_logits go to a copy in the compute dtype (bf16 or f16).
  const bool narrow = backward && args.compute != DType::f32;
  const size_t esize = dtype_size(args.compute);
  auto& impl = ctx.impl();
  float* logits = static_cast<float*>(impl.scratch(Scratch::logits, chunk * V * sizeof(float)));
  void* dl_narrow = narrow ? impl.scratch(Scratch::dlogits, chunk * V * esize) : nullptr;
  const void* dlogits = narrow ? dl_narrow : static_cast<void*>(logits);
  // Per row of a chunk: max, then [sum of exp | target logit] (reduced together).
  std::vector<float> mx(static_cast<size_t>(chunk)), sums(static_cast<size_t>(2 * chunk));
  std::vector<double> loss(static_cast<size_t>(chunk));
  double total_loss = 0.0;
  // The target's column in this slice, or -1.
  auto local_target = [&](int64_t row) -> int64_t {
    const int64_t t = args.targets[row] - first;
    return args.targets[row] >= 0 && t >= 0 && t < valid ? t : -1;
  };

  // One row's max and [sum of exp | target logit]; then, with both reduced
  // over the vocabulary slices, its loss and d_logits.
  auto row_max = [&](int64_t r0, int64_t n, int64_t r) {
    const float* row = logits + r * V;
    const int64_t t = local_target(r0 + r);
    mx[r] = simd::max_of(row, valid);
    sums[n + r] = t >= 0 ? row[t] : 0.0f;
  };
  auto row_exp_sum = [&](int64_t r) {
    sums[r] = simd::exp_shift_sum(logits + r * V, valid, mx[r]);  // logits become exp
  };
  auto row_finish = [&](int64_t r0, int64_t n, int64_t r) {
    float* row = logits + r * V;
    const int32_t target = args.targets[r0 + r];
    const float sum = sums[r];
    if (target < 0) {
      loss[r] = 0.0;
    } else {
      loss[r] = std::log(static_cast<double>(sum)) - (static_cast<double>(sums[n + r]) - mx[r]);
    }
    if (!backward) return;
    if (target < 0) {
      if (narrow) {
        std::memset(static_cast<char*>(dl_narrow) + r * V * esize, 0, V * esize);
      } else {
        std::fill(row, row + V, 0.0f);
      }
      return;
    }
    // d_logits = (softmax - onehot) * gs (grad_scale, times the row's weight): in place in f32; in bf16 /
    // f16 scaled straight into the narrow copy (same rounding, one pass
    // less; in f16 a large grad_scale overflows to inf here, which the loss
    // scaler sees in the gradient norm). Padding columns get zero.
    const float gs = args.row_weights != nullptr ? args.grad_scale * args.row_weights[r0 + r]
                                                 : args.grad_scale;
    const float f = gs / sum;
    const int64_t t = local_target(r0 + r);
    if (narrow) {
      simd::dispatch_store(args.compute, dl_narrow, [&](auto* dl) {
        auto* out = dl + r * V;
        simd::scale_row(out, row, f, valid);
        std::memset(static_cast<void*>(out + valid), 0, (V - valid) * esize);
        if (t >= 0) simd::store1(out + t, row[t] * f - gs);
      });
    } else {
      const float target_grad = t >= 0 ? row[t] * f - gs : 0.0f;
      simd::scale_row(row, row, f, valid);
      std::fill(row + valid, row + V, 0.0f);
      if (t >= 0) row[t] = target_grad;
    }
  };
  float* dw_t = transposed_dw(args.compute, args.dw != nullptr)
                    ? static_cast<float*>(impl.scratch(Scratch::dw_t, dim * V * sizeof(float)))
                    : nullptr;

  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    const void* h = static_cast<const char*>(args.h) + r0 * dim * esize;
    matmul(ctx, logits_gemm(n, dim, V), args.compute, h, args.w, DType::f32, logits);
    if (args.reduce_max == nullptr && args.reduce_sum == nullptr) {
      // The whole vocabulary here: each row's passes back to back, while the
      // row is still in this core's cache.
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < n; ++r) {
        row_max(r0, n, r);
        row_exp_sum(r);
        row_finish(r0, n, r);
      }
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < n; ++r) row_max(r0, n, r);
      if (args.reduce_max) args.reduce_max(mx.data(), n);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < n; ++r) row_exp_sum(r);
      if (args.reduce_sum) args.reduce_sum(sums.data(), 2 * n);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < n; ++r) row_finish(r0, n, r);
    }
    for (int64_t r = 0; r < n; ++r) {
      total_loss += loss[r];
      if (args.row_losses != nullptr) args.row_losses[r0 + r] = static_cast<float>(loss[r]);
    }
    if (args.dh != nullptr)
      matmul(ctx, dh_gemm(n, dim, V), args.compute, dlogits, args.w, DType::f32, args.dh + r0 * dim);
    if (dw_t != nullptr) {
      matmul(ctx, dw_t_gemm(n, dim, V), args.compute, h, dlogits, DType::f32, dw_t, 1.0f, r0 > 0);
    } else if (args.dw != nullptr) {
      matmul(ctx, dw_gemm(n, dim, V), args.compute, dlogits, h, DType::f32, args.dw, 1.0f, true);
    }
  }
  if (dw_t != nullptr && rows > 0) add_transposed(dw_t, dim, V, args.dw);
  return total_loss;
}

ops::ClassifierWorkspace classifier_workspace(int64_t rows, int64_t dim, int64_t vocab,
                                              DType compute, bool trains_w, int threads) {
  ops::ClassifierWorkspace w;
  if (rows <= 0) return w;
  const int64_t chunk = chunk_rows(rows, 0);
  const bool transposed = transposed_dw(compute, trains_w);
  for (const int64_t n : {chunk, rows % chunk}) {
    if (n == 0) continue;
    std::vector<std::pair<MatmulDims, bool>> gemms = {{logits_gemm(n, dim, vocab), false},
                                                      {dh_gemm(n, dim, vocab), false}};
    if (trains_w)
      gemms.push_back({transposed ? dw_t_gemm(n, dim, vocab) : dw_gemm(n, dim, vocab), true});
    for (const auto& [dims, accumulate] : gemms) {
      const MatmulWorkspace g = matmul_workspace(dims, compute, DType::f32, threads, 1.0f, accumulate);
      w.gemms.scratchpad = std::max(w.gemms.scratchpad, g.scratchpad);
      w.gemms.f16_staging = std::max(w.gemms.f16_staging, g.f16_staging);
    }
  }
  const auto elems = static_cast<size_t>(chunk * vocab);
  w.buffers = elems * sizeof(float);
  if (compute != DType::f32) w.buffers += elems * dtype_size(compute);
  if (transposed) w.buffers += static_cast<size_t>(dim * vocab) * sizeof(float);
  return w;
}

}  // namespace meshtrain::cpu
