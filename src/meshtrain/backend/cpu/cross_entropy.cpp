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
  const int64_t chunk = std::max<int64_t>(1, std::min(rows, args.chunk_rows > 0 ? args.chunk_rows
                                                                                 : kDefaultChunkRows));
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
  const float gs = args.grad_scale;
  double total_loss = 0.0;
  // The target's column in this slice, or -1.
  auto local_target = [&](int64_t row) -> int64_t {
    const int64_t t = args.targets[row] - first;
    return args.targets[row] >= 0 && t >= 0 && t < valid ? t : -1;
  };

  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    const void* h = static_cast<const char*>(args.h) + r0 * dim * esize;
    matmul(ctx, {1, n, V, dim, false, true, false}, args.compute, h, args.w, DType::f32, logits);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      const float* row = logits + r * V;
      const int64_t t = local_target(r0 + r);
      mx[r] = simd::max_of(row, valid);
      sums[n + r] = t >= 0 ? row[t] : 0.0f;
    }
    if (args.reduce_max) args.reduce_max(mx.data(), n);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      sums[r] = simd::exp_shift_sum(logits + r * V, valid, mx[r]);  // logits become exp
    }
    if (args.reduce_sum) args.reduce_sum(sums.data(), 2 * n);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float* row = logits + r * V;
      const int32_t target = args.targets[r0 + r];
      const float sum = sums[r];
      if (target < 0) {
        loss[r] = 0.0;
      } else {
        loss[r] = std::log(static_cast<double>(sum)) - (static_cast<double>(sums[n + r]) - mx[r]);
      }
      if (!backward) continue;
      if (target < 0) {
        if (narrow) {
          std::memset(static_cast<char*>(dl_narrow) + r * V * esize, 0, V * esize);
        } else {
          std::fill(row, row + V, 0.0f);
        }
        continue;
      }
      // d_logits = (softmax - onehot) * grad_scale: in place in f32; in bf16 /
      // f16 scaled straight into the narrow copy (same rounding, one pass
      // less; in f16 a large grad_scale overflows to inf here, which the loss
      // scaler sees in the gradient norm). Padding columns get zero.
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
    }
    for (int64_t r = 0; r < n; ++r) {
      total_loss += loss[r];
      if (args.row_losses != nullptr) args.row_losses[r0 + r] = static_cast<float>(loss[r]);
    }
    if (args.dh != nullptr)
      matmul(ctx, {1, n, dim, V, false, false, false}, args.compute, dlogits, args.w, DType::f32,
             args.dh + r0 * dim);
    if (args.dw != nullptr)
      matmul(ctx, {1, V, dim, n, true, false, false}, args.compute, dlogits, h, DType::f32, args.dw,
             1.0f, true);
  }
  return total_loss;
}

}  // namespace meshtrain::cpu
