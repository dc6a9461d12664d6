// Mixture-of-experts routing on the CPU: scores, top-k choice and weights of
// each token (ops::RouterDims), and their backward.
#pragma once

#include <cstdint>

#include "meshtrain/backend/ops.h"

namespace meshtrain::cpu {

// Throws Error naming the field for a shape the router cannot take.
void check_router(const ops::RouterDims& dims);
void router_forward(const ops::RouterDims& dims, const float* logits, float* probs,
                    int32_t* indices, float* weights, float* lse);
void router_backward(const ops::RouterDims& dims, const float* probs, const int32_t* indices,
                     const float* d_weights, const ops::RouterAuxGrad& aux, float* d_logits);

}  // namespace meshtrain::cpu
