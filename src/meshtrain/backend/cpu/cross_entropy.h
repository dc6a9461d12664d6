// The output layer fused with softmax cross-entropy and its backward:
// logits = h · W^T are produced a chunk of rows at a time, turned into the
// loss and into d_logits in place, and consumed by the two backward GEMMs,
// so no [tokens x vocab] buffer is ever kept.
#pragma once

#include <cstdint>
#include <functional>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

using ops::ClassifierArgs;

// Returns the sum over rows of -log softmax(logits)[target].
double fused_classifier(CpuContext& ctx, const ClassifierArgs& args);

// What fused_classifier takes beyond its operands at the default chunk.
ops::ClassifierWorkspace classifier_workspace(int64_t rows, int64_t dim, int64_t vocab,
                                              DType compute, bool trains_w, int threads);

}  // namespace meshtrain::cpu
