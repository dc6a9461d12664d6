// Training samples from token files, and a resumable shuffled order over them.
// A sample is a window of seq+1 tokens starting at a multiple of seq within one
// file (inputs = the first seq, targets = the last seq). The order is a keyed
// permutation per epoch; the sampler's state is a global position
// (epoch, index), so resuming, or later splitting across data-parallel ranks,
// needs nothing else.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/data/token_file.h"

namespace meshtrain {

class TokenDataset {
 public:
  // Opens and validates every file (token ids < vocab_size). Throws Error when
  // no file holds a single sample.
  TokenDataset(const std::vector<std::string>& paths, int64_t vocab_size, int64_t seq_len);

  int64_t num_samples() const { return total_samples_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t num_tokens() const;
  const std::vector<TokenFile>& files() const { return files_; }

  // Writes sample `index` (0 <= index < num_samples) as seq inputs and seq targets.
  void read_sample(int64_t index, int32_t* inputs, int32_t* targets) const;

 private:
  std::vector<TokenFile> files_;
  std::vector<int64_t> first_sample_;  // of each file, plus the total at the end
  int64_t seq_len_ = 0;
  int64_t total_samples_ = 0;
};

// A bijection of [0, n) chosen by `key`: a balanced Feistel network on the
// next even power of two, cycle-walked into range. O(1) memory, random access.
class KeyedPermutation {
 public:
  KeyedPermutation(uint64_t n, uint64_t key);
  uint64_t operator()(uint64_t i) const;
  uint64_t size() const { return n_; }

 private:
  uint64_t n_, key_;
  unsigned half_bits_;
  uint64_t half_mask_;
};

struct SamplerPosition {
  int64_t epoch = 0;
  int64_t index = 0;  // position within the epoch's order
  bool operator==(const SamplerPosition&) const = default;
};

// Hands out sample indices in a shuffled order keyed by (seed, epoch).
class ShuffledSampler {
 public:
  ShuffledSampler(int64_t num_samples, uint64_t seed);

  // The sample at the current position; then advances (wrapping into the next epoch).
  int64_t next();
  SamplerPosition position() const { return position_; }
  // Restores a saved position; throws Error if it is out of range for this data.
  void set_position(SamplerPosition position);
  int64_t num_samples() const { return num_samples_; }

 private:
  KeyedPermutation order(int64_t epoch) const;
  int64_t num_samples_;
  uint64_t seed_;
  SamplerPosition position_;
  KeyedPermutation current_;
};

}  // namespace meshtrain
