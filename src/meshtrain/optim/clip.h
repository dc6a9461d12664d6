// Global gradient-norm clipping.
#pragma once

#include "meshtrain/model/model.h"

namespace meshtrain {

// sqrt(sum over all gradients of g^2), computed in double, deterministic.
double global_grad_norm(const Model& model);

// The factor to multiply gradients by so that their norm is at most max_norm
// (1 when max_norm <= 0 or the norm is already below it).
float clip_factor(double grad_norm, float max_norm);

}  // namespace meshtrain
