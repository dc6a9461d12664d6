// Mixture-of-experts routing on the CPU: scores, top-k choice and weights of
// each token (ops::RouterDims), and their backward.
#pragma once

#include <cstdint>

#include "meshtrain/backend/ops.h"

namespace meshtrain::cpu {

// Both refuse dims ops::check_router refuses; the per-token math is backend/routing.h's.
void router_forward(const ops::RouterDims& dims, const float* logits, float* probs,
                    int32_t* indices, float* weights, float* lse);
void router_backward(const ops::RouterDims& dims, const float* probs, const int32_t* indices,
                     const float* d_weights, const ops::RouterAuxGrad& aux, float* d_logits);

}  // namespace meshtrain::cpu
