// Training samples from token files, and the global order over them.
// A sample is a window of seq+1 tokens starting at a multiple of seq within one
// file (inputs = the first seq, targets = the last seq). The order is global
// (the same on every rank): epoch e visits the samples in a keyed permutation
// of (seed, e), cut into global batches of G consecutive positions. A position
// (epoch, index) is the whole state, so resuming, with any data-parallel size,
// needs nothing else.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/data/token_file.h"

namespace meshtrain {

// Samples by index: a TokenDataset, or a test's stand-in. read_sample must be
// safe to call from another thread (the loader's prefetch thread).
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t num_samples() const = 0;
  virtual int64_t seq_len() const = 0;
  // Writes sample `index` (0 <= index < num_samples) as seq inputs and seq targets
  // (a negative target is not in the loss: SFT prompts and padding).
  virtual void read_sample(int64_t index, int32_t* inputs, int32_t* targets) const = 0;
  // Packed records (data/sft.h): samples carry each token's position in its
  // record (ops::AttentionDims::positions). false: one sequence per sample.
  virtual bool has_positions() const { return false; }
  virtual void read_positions(int64_t /*index*/, int32_t* /*positions*/) const {}
  // Targets of sample `index` that count in the loss (>= 0): the step's loss
  // normalisation sums this over the global batch.
  virtual int64_t loss_tokens(int64_t /*index*/) const { return seq_len(); }
  // One phrase for the run's start-up line ("4000 tokens, 250 samples of 16 (+1) tokens").
  virtual std::string describe() const { return std::to_string(num_samples()) + " samples"; }
};

class TokenDataset final : public SampleSource {
 public:
  // Opens and validates every file (token ids < vocab_size). Throws Error when
  // no file holds a single sample.
  TokenDataset(const std::vector<std::string>& paths, int64_t vocab_size, int64_t seq_len);

  int64_t num_samples() const override { return total_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  int64_t num_tokens() const;
  const std::vector<TokenFile>& files() const { return files_; }

  void read_sample(int64_t index, int32_t* inputs, int32_t* targets) const override;
  std::string describe() const override;

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

// A position in the global order: the index-th sample of epoch `epoch`'s permutation.
struct SamplerPosition {
  int64_t epoch = 0;
  int64_t index = 0;
  bool operator==(const SamplerPosition&) const = default;
};

// The global order, walked in global batches of G positions. An epoch holds
// floor(N / G) full batches: when fewer than G positions remain, the epoch
// ends there (those N mod G samples sit elsewhere in the next epoch's
// permutation), so every batch is full and no batch spans two epochs.
class GlobalOrder {
 public:
  // Throws Error when num_samples < global_batch (not even one batch).
  GlobalOrder(int64_t num_samples, uint64_t seed, int64_t global_batch);

  int64_t num_samples() const { return num_samples_; }
  int64_t global_batch() const { return global_batch_; }
  int64_t batches_per_epoch() const { return num_samples_ / global_batch_; }

  // The permutation of `epoch` (sample at index i = order(epoch)(i)).
  KeyedPermutation order(int64_t epoch) const;
  // Where the batch at or after `p` starts: p, or the next epoch's start when
  // fewer than G positions remain. Throws Error on a position out of range.
  SamplerPosition batch_start(SamplerPosition p) const;
  // The start of the batch after the one at batch_start(p).
  SamplerPosition next_batch(SamplerPosition p) const;

 private:
  int64_t num_samples_, global_batch_;
  uint64_t seed_;
};

}  // namespace meshtrain
