// The fused classifier's per-row softmax cross-entropy over one chunk of
// logits (the GEMMs around it are cuBLASLt's, cuda_backend.cpp): a block per row.
#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

template <typename E>
__global__ void classifier_rows_kernel(ClassifierRows c, const float* logits, double* losses,
                                       typename E::T* d_logits) {
  __shared__ float scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  const float* row = logits + r * c.ld;
  const int64_t target = c.targets[r];
  const int64_t local = target - c.offset;
  const bool counted = target >= 0 && local >= 0 && local < c.valid;
  float mx = 0.0f, sum = 0.0f, target_logit = 0.0f;
  if (c.stats != nullptr) {  // the whole vocabulary's, combined over the slices
    mx = c.stats[r];
    sum = c.stats[c.rows + r];
    target_logit = c.stats[2 * c.rows + r];
  } else {
    mx = math::negative_infinity();
    for (int64_t j = threadIdx.x; j < c.valid; j += kThreads) mx = fmaxf(mx, row[j]);
    mx = block_max(mx, scratch);
    for (int64_t j = threadIdx.x; j < c.valid; j += kThreads) sum += expf(row[j] - mx);
    sum = block_sum(sum, scratch);
    target_logit = counted ? row[local] : 0.0f;
  }
  if (threadIdx.x == 0) {
    // Every slice's rank counts a row whose target is anywhere in the vocabulary.
    const bool scored = c.stats != nullptr ? target >= 0 : counted;
    losses[r] = scored ? log(static_cast<double>(sum)) -
                             (static_cast<double>(target_logit) - static_cast<double>(mx))
                       : 0.0;
  }
  if (d_logits == nullptr) return;
  const float scale = target >= 0 ? c.grad_scale * (c.row_weights != nullptr ? c.row_weights[r] : 1.0f)
                                  : 0.0f;
  const float inv = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < c.ld; j += kThreads) {
    float g = 0.0f;
    if (j < c.valid) g = (expf(row[j] - mx) * inv - (j == local ? 1.0f : 0.0f)) * scale;
    d_logits[r * c.ld + j] = E::store(g);
  }
}

// A block per row: its max and target logit (exp_sums false), or its sum of
// exp(logit - max) given the combined max (true).
__global__ void classifier_stats_kernel(ClassifierRows c, const float* logits, float* stats,
                                        bool exp_sums) {
  __shared__ float scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  const float* row = logits + r * c.ld;
  if (exp_sums) {
    const float mx = stats[r];
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < c.valid; j += kThreads) sum += expf(row[j] - mx);
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) stats[c.rows + r] = sum;
    return;
  }
  float mx = math::negative_infinity();
  for (int64_t j = threadIdx.x; j < c.valid; j += kThreads) mx = fmaxf(mx, row[j]);
  mx = block_max(mx, scratch);
  if (threadIdx.x == 0) {
    const int64_t local = static_cast<int64_t>(c.targets[r]) - c.offset;
    stats[r] = mx;
    stats[2 * c.rows + r] =
        c.targets[r] >= 0 && local >= 0 && local < c.valid ? row[local] : 0.0f;
  }
}

}  // namespace

void launch_classifier_stats(cudaStream_t s, const ClassifierRows& c, const float* logits,
                             float* stats, bool exp_sums) {
  if (c.rows == 0) return;
  classifier_stats_kernel<<<static_cast<unsigned>(c.rows), kThreads, 0, s>>>(c, logits, stats,
                                                                            exp_sums);
  check_launch("classifier stats");
}

void launch_classifier_rows(cudaStream_t s, const ClassifierRows& c, const float* logits,
                            double* losses, Elem grad_dtype, void* d_logits) {
  if (c.rows == 0) return;
  with_elem(grad_dtype, [&](auto tag) {
    using E = decltype(tag);
    classifier_rows_kernel<E><<<static_cast<unsigned>(c.rows), kThreads, 0, s>>>(
        c, logits, losses, static_cast<typename E::T*>(d_logits));
  });
  check_launch("classifier");
}

}  // namespace meshtrain::cuda
