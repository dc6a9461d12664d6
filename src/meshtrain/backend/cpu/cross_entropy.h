// The output layer fused with softmax cross-entropy and its backward:
// logits = h · W^T are produced a chunk of rows at a time, turned into the
// loss and into d_logits in place, and consumed by the two backward GEMMs,
// so no [tokens x vocab] buffer is ever kept.
#pragma once

#include <cstdint>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

struct ClassifierArgs {
  int64_t rows = 0, dim = 0, vocab = 0;
  DType compute = DType::f32;   // dtype of h and w
  const void* h = nullptr;      // [rows, dim]
  const void* w = nullptr;      // [vocab, dim] (the embedding layout)
  const int32_t* targets = nullptr;  // [rows]; a negative target is ignored (no loss, no grad)
  float grad_scale = 0.0f;      // d(total loss)/d(row loss), e.g. 1/(tokens in the step)
  float* dh = nullptr;          // [rows, dim] f32, overwritten; nullptr = no backward
  float* dw = nullptr;          // [vocab, dim] f32, accumulated; nullptr = no backward
  float* row_losses = nullptr;  // optional [rows]
  int64_t chunk_rows = 0;       // rows per logits chunk; 0 = the backend's default
};

// Returns the sum over rows of -log softmax(logits)[target].
double fused_classifier(CpuContext& ctx, const ClassifierArgs& args);

}  // namespace meshtrain::cpu
