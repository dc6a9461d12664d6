// The output layer fused with softmax cross-entropy and its backward:
// logits = h · W^T are produced a chunk of rows at a time, turned into the
// loss and into d_logits in place, and consumed by the two backward GEMMs,
// so no [tokens x vocab] buffer is ever kept.
#pragma once

#include <cstdint>
#include <functional>

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

  // Vocab parallel: w holds rows [vocab_offset, vocab_offset + vocab) of a
  // vocab_total-row output layer, of which the first vocab_valid are real (the
  // rest is padding: excluded from the softmax, zero gradient). reduce_max and
  // reduce_sum combine per-row values in place over the ranks holding the
  // other slices, so full-vocabulary logits never exist on one rank. dh is
  // then this slice's partial sum. Defaults: one rank, the whole vocabulary.
  int64_t vocab_offset = 0, vocab_valid = -1, vocab_total = 0;
  std::function<void(float* values, int64_t n)> reduce_max = nullptr, reduce_sum = nullptr;
};

// Returns the sum over rows of -log softmax(logits)[target].
double fused_classifier(CpuContext& ctx, const ClassifierArgs& args);

}  // namespace meshtrain::cpu
