// Token (and learned position) embeddings.
#pragma once

#include <cstdint>
#include <limits>

namespace meshtrain::cpu {

// out[b*T + t] = table[ids[b*T + t]] (+ positions[pos0 + t] when positions != nullptr;
// pos_ids != nullptr: positions[pos_ids[b*T + t]], packed records restarting at 0).
void embedding_forward(const float* table, const float* positions, const int32_t* ids, float* out,
                       int64_t batch, int64_t seq, int64_t dim, int64_t pos0 = 0,
                       const int32_t* pos_ids = nullptr);
// dtable[ids[i] - vocab_begin] += dout[i] for the ids in [vocab_begin, vocab_end)
// (a rank's vocabulary slice; by default every id); dpositions[t] += sum_b
// dout[b, t] over every token (when not nullptr; at pos_ids[b*T + t] when given).
// Deterministic: the result does not depend on the thread count.
void embedding_backward(const int32_t* ids, const float* dout, float* dtable, float* dpositions,
                        int64_t batch, int64_t seq, int64_t dim, int64_t vocab_begin = 0,
                        int64_t vocab_end = std::numeric_limits<int64_t>::max(),
                        const int32_t* pos_ids = nullptr);

}  // namespace meshtrain::cpu
