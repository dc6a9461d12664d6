// Vocab-parallel token embedding: a rank holds table rows [begin, end) of the
// vocabulary; tokens outside give zero rows, so the sum over the tp ranks is
// the full lookup. (The loss side is Backend::fused_classifier's vocab slice.)
#pragma once

#include <cstdint>

#include "meshtrain/tensor/dtype.h"

namespace meshtrain {

// out[i] = table[ids[i] - begin] if begin <= ids[i] < end, else 0 (f32 out).
// table: [end - begin (+ padding), dim] in `dtype` (f32 or bf16).
void vocab_embedding_forward(const void* table, DType dtype, int64_t begin, int64_t end,
                             const int32_t* ids, int64_t rows, int64_t dim, float* out);
// The backward is Backend::embedding_backward with the slice's [begin, end).

}  // namespace meshtrain
