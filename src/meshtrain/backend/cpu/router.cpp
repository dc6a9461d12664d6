#include "meshtrain/backend/cpu/router.h"

#include <vector>

#include "meshtrain/backend/routing.h"

namespace meshtrain::cpu {

namespace {

routing::Params params(const ops::RouterDims& d) {
  return {d.experts, d.top_k, d.n_groups, d.topk_groups, d.score == ops::RouterScore::softmax,
          d.renormalize, d.scaling, d.bias};
}

}  // namespace

void router_forward(const ops::RouterDims& d, const float* logits, float* probs, int32_t* indices,
                    float* weights, float* lse) {
  ops::check_router(d);
  const routing::Params r = params(d);
  const int64_t E = d.experts, K = d.top_k;
#pragma omp parallel
  {
    std::vector<float> sel(static_cast<size_t>(E)), group_score(static_cast<size_t>(d.n_groups));
    std::vector<uint8_t> candidate(static_cast<size_t>(E)), group_candidate(group_score.size());
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.tokens; ++t) {
      routing::route_token(r, logits + t * E, probs + t * E, indices + t * K, weights + t * K,
                           lse != nullptr ? lse + t : nullptr, sel.data(), group_score.data(),
                           candidate.data(), group_candidate.data());
    }
  }
}

void router_backward(const ops::RouterDims& d, const float* probs, const int32_t* indices,
                     const float* d_weights, const ops::RouterAuxGrad& aux, float* d_logits) {
  ops::check_router(d);
  const routing::Params r = params(d);
  const int64_t E = d.experts, K = d.top_k;
#pragma omp parallel
  {
    std::vector<float> dp(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.tokens; ++t) {
      routing::route_token_backward(r, probs + t * E, indices + t * K, d_weights + t * K,
                                    aux.score_grad, aux.z, aux.z != 0 ? aux.lse[t] : 0.0f,
                                    dp.data(), d_logits + t * E);
    }
  }
}

}  // namespace meshtrain::cpu
