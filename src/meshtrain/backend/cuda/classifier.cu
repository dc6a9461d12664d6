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
  float mx = math::negative_infinity();
  for (int64_t j = threadIdx.x; j < c.valid; j += kThreads) mx = fmaxf(mx, row[j]);
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < c.valid; j += kThreads) sum += expf(row[j] - mx);
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) {
    losses[r] = counted ? log(static_cast<double>(sum)) -
                              (static_cast<double>(row[local]) - static_cast<double>(mx))
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

}  // namespace

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
