// Mixture-of-experts kernels: the router (backend/routing.h per thread), the
// token permute, the weighted gathers back and the combine's backward.
#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

__global__ void router_forward_kernel(routing::Params p, int64_t tokens, const float* logits,
                                      float* probs, int32_t* indices, float* weights,
                                      float* lse) {
  float sel[kMaxExperts], group_score[kMaxExperts];
  uint8_t candidate[kMaxExperts], group_candidate[kMaxExperts];
  MESHTRAIN_GRID_STRIDE(t, tokens) {
    const int64_t E = p.experts, K = p.top_k;
    routing::route_token(p, logits + t * E, probs + t * E, indices + t * K, weights + t * K,
                         lse != nullptr ? lse + t : nullptr, sel, group_score, candidate,
                         group_candidate);
  }
}

__global__ void router_backward_kernel(routing::Params p, int64_t tokens, const float* probs,
                                       const int32_t* indices, const float* d_weights,
                                       const float* score_grad, float z, const float* lse,
                                       float* d_logits) {
  float dp[kMaxExperts];
  MESHTRAIN_GRID_STRIDE(t, tokens) {
    const int64_t E = p.experts, K = p.top_k;
    routing::route_token_backward(p, probs + t * E, indices + t * K, d_weights + t * K,
                                  score_grad, z, z != 0 ? lse[t] : 0.0f, dp, d_logits + t * E);
  }
}

template <typename E>
__global__ void permute_kernel(int64_t slots, int64_t top_k, int64_t dim,
                               const int32_t* slot_of_row, const float* x, typename E::T* y) {
  MESHTRAIN_GRID_STRIDE(i, slots * dim) {
    const int64_t r = i / dim, d = i % dim;
    y[i] = E::store(x[static_cast<int64_t>(slot_of_row[r]) / top_k * dim + d]);
  }
}

__global__ void gather_sum_kernel(int64_t tokens, int64_t top_k, int64_t dim, const int32_t* rows,
                                  const float* weights, const float* y, float* out) {
  MESHTRAIN_GRID_STRIDE(i, tokens * dim) {
    const int64_t t = i / dim, d = i % dim;
    float acc = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t r = rows[t * top_k + j];
      if (r < 0) continue;  // dropped
      const float w = weights != nullptr ? weights[t * top_k + j] : 1.0f;
      acc += w * y[r * dim + d];
    }
    out[i] = acc;
  }
}

template <typename E>
__global__ void combine_backward_rows_kernel(int64_t slots, int64_t top_k, int64_t dim,
                                             const int32_t* rows, const float* weights,
                                             const float* d_out, typename E::T* d_y) {
  MESHTRAIN_GRID_STRIDE(i, slots * dim) {
    const int64_t s = i / dim, d = i % dim, r = rows[s];
    if (r >= 0) d_y[r * dim + d] = E::store(weights[s] * d_out[s / top_k * dim + d]);
  }
}

// One block per slot: <d_out[t], y[row]> in a fixed tree.
__global__ void combine_backward_weights_kernel(int64_t top_k, int64_t dim, const int32_t* rows,
                                                const float* y, const float* d_out,
                                                float* d_weights) {
  __shared__ float scratch[kThreads / 32];
  const int64_t s = blockIdx.x, r = rows[s];
  float dot = 0.0f;
  if (r >= 0) {
    const float* g = d_out + s / top_k * dim;
    for (int64_t d = threadIdx.x; d < dim; d += kThreads) dot += g[d] * y[r * dim + d];
  }
  dot = block_sum(dot, scratch);
  if (threadIdx.x == 0) d_weights[s] = dot;
}

}  // namespace

void launch_router_forward(cudaStream_t s, const routing::Params& p, int64_t tokens,
                           const float* logits, float* probs, int32_t* indices, float* weights,
                           float* lse) {
  if (tokens == 0) return;
  router_forward_kernel<<<blocks_for(tokens), kThreads, 0, s>>>(p, tokens, logits, probs, indices,
                                                                weights, lse);
  check_launch("router_forward");
}

void launch_router_backward(cudaStream_t s, const routing::Params& p, int64_t tokens,
                            const float* probs, const int32_t* indices, const float* d_weights,
                            const float* score_grad, float z, const float* lse, float* d_logits) {
  if (tokens == 0) return;
  router_backward_kernel<<<blocks_for(tokens), kThreads, 0, s>>>(
      p, tokens, probs, indices, d_weights, score_grad, z, lse, d_logits);
  check_launch("router_backward");
}

void launch_moe_permute(cudaStream_t s, int64_t slots, int64_t top_k, int64_t dim,
                        const int32_t* slot_of_row, const float* x, Elem out_dtype, void* y) {
  if (slots * dim == 0) return;
  with_elem(out_dtype, [&](auto tag) {
    using E = decltype(tag);
    permute_kernel<E><<<blocks_for(slots * dim), kThreads, 0, s>>>(
        slots, top_k, dim, slot_of_row, x, static_cast<typename E::T*>(y));
  });
  check_launch("moe_permute");
}

void launch_moe_gather_sum(cudaStream_t s, int64_t tokens, int64_t top_k, int64_t dim,
                           const int32_t* rows, const float* weights, const float* y, float* out) {
  if (tokens * dim == 0) return;
  gather_sum_kernel<<<blocks_for(tokens * dim), kThreads, 0, s>>>(tokens, top_k, dim, rows,
                                                                  weights, y, out);
  check_launch("moe gather");
}

void launch_moe_combine_backward(cudaStream_t s, int64_t tokens, int64_t top_k, int64_t dim,
                                 const int32_t* rows, const float* weights, const float* y,
                                 const float* d_out, Elem grad_dtype, void* d_y,
                                 float* d_weights) {
  const int64_t slots = tokens * top_k;
  if (slots == 0) return;
  with_elem(grad_dtype, [&](auto tag) {
    using E = decltype(tag);
    combine_backward_rows_kernel<E><<<blocks_for(slots * dim), kThreads, 0, s>>>(
        slots, top_k, dim, rows, weights, d_out, static_cast<typename E::T*>(d_y));
  });
  combine_backward_weights_kernel<<<static_cast<unsigned>(slots), kThreads, 0, s>>>(
      top_k, dim, rows, y, d_out, d_weights);
  check_launch("moe_combine_backward");
}

}  // namespace meshtrain::cuda
