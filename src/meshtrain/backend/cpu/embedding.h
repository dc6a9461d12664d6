// Token (and learned position) embeddings: Backend::embedding_forward and
// embedding_backward on the CPU (ops::EmbeddingDims says what each index means).
#pragma once

#include <cstdint>

#include "meshtrain/backend/ops.h"

namespace meshtrain::cpu {

using ops::EmbeddingDims;

// out[i] = table[ids[i] - vocab_begin] as f32, zero rows for ids outside the
// slice, + positions[dims.position(i)] when positions != nullptr. table: f32,
// bf16 or f16.
void embedding_forward(const EmbeddingDims& dims, const void* table, DType table_dtype,
                       const float* positions, const int32_t* ids, float* out);
// dtable[ids[i] - vocab_begin] += dout[i] for the ids in the slice;
// dpositions[dims.position(i)] += dout[i] over every token (when not nullptr).
// Deterministic: the result does not depend on the thread count.
void embedding_backward(const EmbeddingDims& dims, const int32_t* ids, const float* dout,
                        float* dtable, float* dpositions);

}  // namespace meshtrain::cpu
