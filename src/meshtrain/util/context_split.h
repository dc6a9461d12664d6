// Context parallelism's cut of a sequence (parallel.cp, Megatron-Core's
// load-balanced layout): a sequence of `seq` tokens is cut into 2 x size
// chunks of seq / (2 size) tokens and rank r of the cp group holds chunks r
// and 2 size - 1 - r, in that order, so every rank's share of the causal
// attention costs the same. Labels are shifted on the whole sequence before
// the cut (a sample's targets are already its inputs' next tokens), so every
// token's loss is counted once, on the rank that holds its input.
//
// The data loader cuts samples with it and the attention kernels map a local
// token back to its global index with it; both read this one definition.
#pragma once

#include <cstdint>
#include <cstring>

namespace meshtrain {

struct ContextSplit {
  int64_t rank = 0, size = 1;

  bool active() const { return size > 1; }
  int64_t local(int64_t seq) const { return seq / size; }         // this rank's tokens
  int64_t chunk(int64_t seq) const { return seq / (2 * size); }   // tokens per chunk
  // The global index of local token i (0 <= i < local(seq)).
  int64_t global(int64_t seq, int64_t i) const {
    const int64_t c = chunk(seq), k = i / c;
    return (k == 0 ? rank : 2 * size - 1 - rank) * c + i % c;
  }
  // This rank's tokens of `rows` rows of `seq` values: whole [rows, seq] ->
  // local [rows, local(seq)] (T = any trivially copyable element).
  template <typename T>
  void cut(const T* whole, T* local_out, int64_t rows, int64_t seq) const {
    const int64_t c = chunk(seq), l = local(seq);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < 2; ++k) {
        std::memcpy(local_out + r * l + k * c, whole + r * seq + global(seq, k * c),
                    static_cast<size_t>(c) * sizeof(T));
      }
    }
  }
};

}  // namespace meshtrain
