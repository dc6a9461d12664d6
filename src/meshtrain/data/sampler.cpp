#include "meshtrain/data/sampler.h"

#include <algorithm>
#include <bit>

#include <fmt/format.h>

#include "meshtrain/util/error.h"
#include "meshtrain/util/rng.h"

namespace meshtrain {

TokenDataset::TokenDataset(const std::vector<std::string>& paths, int64_t vocab_size,
                           int64_t seq_len)
    : seq_len_(seq_len) {
  MESHTRAIN_CHECK(seq_len > 0, "data: seq_len must be > 0, got {}", seq_len);
  MESHTRAIN_CHECK(!paths.empty(), "data: no token files given");
  first_sample_.push_back(0);
  for (const std::string& path : paths) {
    files_.emplace_back(path, vocab_size);
    int64_t n = files_.back().size();
    int64_t samples = n > seq_len ? (n - 1) / seq_len : 0;
    first_sample_.push_back(first_sample_.back() + samples);
  }
  total_samples_ = first_sample_.back();
  MESHTRAIN_CHECK(total_samples_ > 0,
                  "data file '{}'{}: too short for one sample of seq_len + 1 = {} tokens",
                  paths.front(), paths.size() > 1 ? " (and the others)" : "", seq_len + 1);
}

int64_t TokenDataset::num_tokens() const {
  int64_t n = 0;
  for (const TokenFile& f : files_) n += f.size();
  return n;
}

std::string TokenDataset::describe() const {
  return fmt::format("{} tokens, {} samples of {} (+1) tokens", num_tokens(), num_samples(),
                     seq_len_);
}

void TokenDataset::read_sample(int64_t index, int32_t* inputs, int32_t* targets) const {
  MESHTRAIN_CHECK(index >= 0 && index < total_samples_, "data: sample {} out of range [0, {})",
                  index, total_samples_);
  auto it = std::upper_bound(first_sample_.begin(), first_sample_.end(), index);
  size_t file = static_cast<size_t>(it - first_sample_.begin()) - 1;
  // seq_len + 1 tokens: the inputs, and the targets one further.
  const TokenFile& f = files_[file];
  const int64_t first = (index - first_sample_[file]) * seq_len_;
  f.read(first, seq_len_, inputs);
  f.read(first + 1, seq_len_, targets);
}

KeyedPermutation::KeyedPermutation(uint64_t n, uint64_t key) : n_(n), key_(key) {
  MESHTRAIN_CHECK(n > 0 && n < (uint64_t{1} << 62), "permutation size {} out of range", n);
  unsigned bits = std::max(2u, static_cast<unsigned>(std::bit_width(n - 1)));
  bits += bits & 1u;  // even, so both halves have the same width
  half_bits_ = bits / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
}

uint64_t KeyedPermutation::operator()(uint64_t i) const {
  constexpr int kRounds = 6;
  uint64_t x = i;
  // The domain 2^bits is < 4n, so cycle-walking takes < 4 passes on average.
  do {
    uint64_t left = x >> half_bits_, right = x & half_mask_;
    for (int r = 0; r < kRounds; ++r) {
      uint64_t f = mix64(key_ ^ mix64(right + (static_cast<uint64_t>(r) << 56))) & half_mask_;
      uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

GlobalOrder::GlobalOrder(int64_t num_samples, uint64_t seed, int64_t global_batch)
    : num_samples_(num_samples), global_batch_(global_batch), seed_(seed) {
  MESHTRAIN_CHECK(global_batch > 0, "data: global batch must be > 0, got {}", global_batch);
  MESHTRAIN_CHECK(num_samples >= global_batch,
                  "data: {} training samples, fewer than one global batch of train.batch_size = {}",
                  num_samples, global_batch);
}

KeyedPermutation GlobalOrder::order(int64_t epoch) const {
  uint64_t key = mix64(stream_key(seed_, "data.order") ^ mix64(static_cast<uint64_t>(epoch)));
  return KeyedPermutation(static_cast<uint64_t>(num_samples_), key);
}

SamplerPosition GlobalOrder::batch_start(SamplerPosition p) const {
  MESHTRAIN_CHECK(p.epoch >= 0 && p.index >= 0 && p.index <= num_samples_,
                  "data: position (epoch {}, index {}) out of range for {} samples", p.epoch,
                  p.index, num_samples_);
  if (p.index + global_batch_ > num_samples_) return {p.epoch + 1, 0};
  return p;
}

SamplerPosition GlobalOrder::next_batch(SamplerPosition p) const {
  SamplerPosition start = batch_start(p);
  return batch_start({start.epoch, start.index + global_batch_});
}

}  // namespace meshtrain
