// The distributed loader: every epoch's samples exactly once across ranks for
// dp = 1..4, determinism, resume at any step and into another dp, prefetch ==
// synchronous, errors from the prefetch thread, the fixed validation set.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "meshtrain/data/loader.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/util/error.h"
#include "support/scratch.h"

namespace meshtrain {
namespace {

// Sample i is the tokens i*100 + t; reading sample `poison` throws.
class FakeSource final : public SampleSource {
 public:
  FakeSource(int64_t n, int64_t seq, int64_t poison = -1) : n_(n), seq_(seq), poison_(poison) {}
  int64_t num_samples() const override { return n_; }
  int64_t seq_len() const override { return seq_; }
  void read_sample(int64_t index, int32_t* inputs, int32_t* targets) const override {
    MESHTRAIN_CHECK(index != poison_, "data file 'fake.bin': sample {} is unreadable", index);
    for (int64_t t = 0; t < seq_; ++t) {
      inputs[t] = static_cast<int32_t>(index * 100 + t);
      targets[t] = static_cast<int32_t>(index * 100 + t + 1);
    }
  }

 private:
  int64_t n_, seq_, poison_;
};

LoaderOptions options(int64_t global, int64_t micro, int64_t rank, int64_t dp, int prefetch = 2,
                      uint64_t seed = 7) {
  LoaderOptions o;
  o.global_batch = global;
  o.micro_batch = micro;
  o.dp_rank = rank;
  o.dp_size = dp;
  o.seed = seed;
  o.prefetch = prefetch;
  return o;
}

// The samples one rank sees over `steps` steps, step by step.
std::vector<std::vector<int64_t>> rank_steps(const SampleSource& source, const LoaderOptions& o,
                                             int64_t steps, SamplerPosition start = {},
                                             SamplerPosition* end = nullptr) {
  DataLoader loader(source, o, start);
  std::vector<std::vector<int64_t>> out;
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<int64_t> step;
    for (int64_t k = 0; k < loader.micro_batches_per_step(); ++k) {
      const MicroBatch& b = loader.next();
      EXPECT_EQ(b.rows, o.micro_batch);
      // The rows hold the listed samples.
      for (int64_t r = 0; r < b.rows; ++r) {
        EXPECT_EQ(b.inputs[static_cast<size_t>(r * b.seq_len)], b.samples[static_cast<size_t>(r)] * 100);
      }
      step.insert(step.end(), b.samples.begin(), b.samples.end());
    }
    out.push_back(step);
  }
  if (end != nullptr) *end = loader.position();
  return out;
}

// Each global step as the concatenation of the ranks' shares in rank order.
std::vector<std::vector<int64_t>> global_steps(const SampleSource& source, int64_t global,
                                               int64_t micro, int64_t dp, int64_t steps,
                                               SamplerPosition start = {},
                                               SamplerPosition* end = nullptr) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(steps));
  for (int64_t r = 0; r < dp; ++r) {
    SamplerPosition rank_end;
    auto mine = rank_steps(source, options(global, micro, r, dp), steps, start, &rank_end);
    if (end != nullptr) {
      if (r > 0) {
        EXPECT_EQ(rank_end, *end) << "ranks disagree on the position";
      }
      *end = rank_end;
    }
    for (size_t s = 0; s < out.size(); ++s) out[s].insert(out[s].end(), mine[s].begin(), mine[s].end());
  }
  return out;
}

TEST(Loader, EachEpochIsExactlyTheSampleSetForDp1To4) {
  const int64_t global = 12;
  for (int64_t n : {60, 67}) {  // 67: the last 7 positions of each epoch are dropped
    FakeSource source(n, 3);
    GlobalOrder order(n, 7, global);
    ASSERT_EQ(order.batches_per_epoch(), 5);
    for (int64_t dp = 1; dp <= 4; ++dp) {
      for (int64_t micro : {int64_t{1}, global / dp}) {
        SamplerPosition end;
        auto steps = global_steps(source, global, micro, dp, 10, {}, &end);
        EXPECT_EQ(end, (SamplerPosition{2, 0})) << "dp " << dp;
        for (int epoch = 0; epoch < 2; ++epoch) {
          std::vector<int64_t> seen;
          for (int s = epoch * 5; s < epoch * 5 + 5; ++s) {
            ASSERT_EQ(steps[static_cast<size_t>(s)].size(), static_cast<size_t>(global));
            seen.insert(seen.end(), steps[static_cast<size_t>(s)].begin(),
                        steps[static_cast<size_t>(s)].end());
          }
          // In the global order, with each position taken exactly once.
          KeyedPermutation perm = order.order(epoch);
          std::vector<int64_t> expected;
          for (int64_t i = 0; i < 60; ++i) expected.push_back(static_cast<int64_t>(perm(static_cast<uint64_t>(i))));
          EXPECT_EQ(seen, expected) << "n " << n << " dp " << dp << " micro " << micro;
          std::set<int64_t> unique(seen.begin(), seen.end());
          EXPECT_EQ(unique.size(), seen.size());
          if (n == 60) {  // every sample
            std::set<int64_t> all;
            for (int64_t i = 0; i < n; ++i) all.insert(i);
            EXPECT_EQ(unique, all);
          }
        }
      }
    }
  }
}

TEST(Loader, EpochsDifferAndRunsRepeat) {
  FakeSource source(40, 2);
  auto a = rank_steps(source, options(8, 4, 0, 1), 10);
  auto b = rank_steps(source, options(8, 4, 0, 1), 10);
  auto other_seed = rank_steps(source, options(8, 4, 0, 1, 2, 8), 10);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other_seed);
  // Epoch 1 (steps 5..9) is another permutation of the same 40 samples.
  std::vector<int64_t> e0, e1;
  for (int s = 0; s < 5; ++s) e0.insert(e0.end(), a[static_cast<size_t>(s)].begin(), a[static_cast<size_t>(s)].end());
  for (int s = 5; s < 10; ++s) e1.insert(e1.end(), a[static_cast<size_t>(s)].begin(), a[static_cast<size_t>(s)].end());
  EXPECT_NE(e0, e1);
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e0, e1);
}

TEST(Loader, ResumeAtAnyStepEqualsTheUninterruptedRun) {
  FakeSource source(53, 2);  // 6 steps of 8 per epoch, 5 dropped
  const int64_t total = 20;
  auto full = rank_steps(source, options(8, 2, 1, 2), total);
  for (int64_t k : {0, 1, 5, 6, 7, 13}) {
    SamplerPosition saved;
    rank_steps(source, options(8, 2, 1, 2), k, {}, &saved);
    EXPECT_EQ(saved, (SamplerPosition{k / 6, (k % 6) * 8})) << k;
    auto resumed = rank_steps(source, options(8, 2, 1, 2), total - k, saved);
    EXPECT_EQ(resumed, std::vector<std::vector<int64_t>>(full.begin() + k, full.end())) << k;
  }
}

TEST(Loader, ResumeWithAnotherDpContinuesAtTheSameGlobalSample) {
  FakeSource source(101, 2);
  const int64_t global = 8, before = 9, after = 11;
  auto uninterrupted = global_steps(source, global, 2, 4, before + after);
  SamplerPosition saved;
  auto first = global_steps(source, global, 2, 4, before, {}, &saved);
  EXPECT_EQ(saved, (SamplerPosition{0, before * global}));
  EXPECT_EQ(first, std::vector<std::vector<int64_t>>(uninterrupted.begin(), uninterrupted.begin() + before));
  // dp = 4 -> 2 (and 1, with another micro-batch size): the same global batches.
  auto dp2 = global_steps(source, global, 4, 2, after, saved);
  auto dp1 = global_steps(source, global, 1, 1, after, saved);
  std::vector<std::vector<int64_t>> rest(uninterrupted.begin() + before, uninterrupted.end());
  EXPECT_EQ(dp2, rest);
  EXPECT_EQ(dp1, rest);
}

TEST(Loader, ResumeWithAnotherBatchSizeStartsAFullBatch) {
  FakeSource source(30, 2);
  GlobalOrder order(30, 7, 8);
  // Saved by G = 6 at index 24: 6 positions left, fewer than G = 8: the next epoch.
  EXPECT_EQ(order.batch_start({0, 24}), (SamplerPosition{1, 0}));
  EXPECT_EQ(order.batch_start({0, 22}), (SamplerPosition{0, 22}));
  EXPECT_EQ(order.next_batch({0, 22}), (SamplerPosition{1, 0}));
  EXPECT_EQ(order.batch_start({3, 30}), (SamplerPosition{4, 0}));
  EXPECT_THROW(order.batch_start({0, 31}), Error);
  EXPECT_THROW(order.batch_start({-1, 0}), Error);
  DataLoader loader(source, options(8, 8, 0, 1), {0, 24});
  EXPECT_EQ(loader.position(), (SamplerPosition{1, 0}));
  KeyedPermutation perm = order.order(1);
  const MicroBatch& b = loader.next();
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(b.samples[static_cast<size_t>(i)], static_cast<int64_t>(perm(static_cast<uint64_t>(i))));
  EXPECT_EQ(loader.position(), (SamplerPosition{1, 8}));
}

TEST(Loader, PrefetchDeliversTheSynchronousSequence) {
  FakeSource source(97, 5);
  for (int64_t dp : {1, 3}) {
    for (int64_t rank = 0; rank < dp; ++rank) {
      DataLoader sync(source, options(12, 2, rank, dp, 0));
      DataLoader one(source, options(12, 2, rank, dp, 1));
      DataLoader deep(source, options(12, 2, rank, dp, 4));
      for (int i = 0; i < 60; ++i) {
        const MicroBatch& s = sync.next();
        const MicroBatch& a = one.next();
        const MicroBatch& b = deep.next();
        ASSERT_EQ(a.samples, s.samples) << i;
        ASSERT_EQ(b.samples, s.samples) << i;
        ASSERT_EQ(a.inputs, s.inputs) << i;
        ASSERT_EQ(b.targets, s.targets) << i;
      }
      EXPECT_EQ(sync.position(), deep.position());
      EXPECT_EQ(deep.stats().micro_batches, 60);
    }
  }
}

TEST(Loader, ReadsTokenFileWindows) {
  std::string dir = testing::scratch_dir();
  std::vector<uint16_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % 500);
  write_token_file(dir + "/a.bin", tokens);
  TokenDataset data({dir + "/a.bin"}, 500, 10);  // 99 windows
  DataLoader loader(data, options(6, 3, 1, 2));
  for (int i = 0; i < 40; ++i) {
    const MicroBatch& b = loader.next();
    for (int64_t r = 0; r < 3; ++r) {
      int64_t start = b.samples[static_cast<size_t>(r)] * 10;
      for (int64_t t = 0; t < 10; ++t) {
        ASSERT_EQ(b.inputs[static_cast<size_t>(r * 10 + t)], (start + t) % 500);
        ASSERT_EQ(b.targets[static_cast<size_t>(r * 10 + t)], (start + t + 1) % 500);
      }
    }
  }
}

// Context parallelism's cut (util/context_split.h): over the cp ranks every
// global index is held exactly once, rank r holds chunks r and 2cp - 1 - r,
// and a rank's targets are the whole row's shifted labels at its tokens (the
// next token of the whole sequence, also across a chunk's end), so every
// token's loss is counted once. Positions are global indices.
TEST(Loader, ContextParallelRanksHoldEveryTokenOnceWithWholeRowLabels) {
  std::string dir = testing::scratch_dir();
  std::vector<uint16_t> tokens(2000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % 700);
  write_token_file(dir + "/a.bin", tokens);
  const int64_t seq = 24;
  TokenDataset data({dir + "/a.bin"}, 700, seq);
  for (int64_t cp : {1, 2, 3}) {
    std::vector<int> seen(static_cast<size_t>(2 * seq), 0);  // two rows
    for (int64_t r = 0; r < cp; ++r) {
      LoaderOptions o = options(4, 2, 0, 1);
      o.context = ContextSplit{r, cp};
      DataLoader loader(data, o);
      const MicroBatch& b = loader.next();
      ASSERT_EQ(b.seq_len, seq / cp);
      ASSERT_EQ(b.positions.size(), cp > 1 ? b.inputs.size() : 0);  // cp 1: whole rows
      const int64_t c = seq / (2 * cp);
      for (int64_t row = 0; row < 2; ++row) {
        const int64_t start = b.samples[static_cast<size_t>(row)] * seq;
        for (int64_t i = 0; i < b.seq_len; ++i) {
          const auto at = static_cast<size_t>(row * b.seq_len + i);
          const int64_t chunk = i < c ? r : 2 * cp - 1 - r, g = chunk * c + i % c;
          EXPECT_EQ(o.context.global(seq, i), g);
          if (cp > 1) {
            EXPECT_EQ(b.positions[at], g);
          }
          EXPECT_EQ(b.inputs[at], (start + g) % 700);
          EXPECT_EQ(b.targets[at], (start + g + 1) % 700) << "cp " << cp << " token " << i;
          ++seen[static_cast<size_t>(row * seq + g)];
        }
      }
    }
    for (int n : seen) EXPECT_EQ(n, 1) << "cp " << cp;
  }
  // A sequence the cp ranks cannot cut evenly: one line naming the key.
  LoaderOptions bad = options(4, 2, 0, 1, 0);
  bad.context = ContextSplit{0, 5};
  DataLoader loader(data, bad);
  try {
    loader.next();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "data: sequence length 24 is not divisible by 2 x parallel.cp = 10");
  }
}

// The Error (by message) of the micro-batch after `good` good ones, or "".
std::string error_after(const SampleSource& source, const LoaderOptions& o, int good) {
  DataLoader loader(source, o);
  for (int i = 0; i < good; ++i) loader.next();
  try {
    loader.next();
  } catch (const Error& e) {
    std::string first = e.what();
    // Sticky: the next call reports it again; the destructor still joins.
    try {
      loader.next();
    } catch (const Error& again) {
      EXPECT_EQ(first, again.what());
      return first;
    }
    ADD_FAILURE() << "second next() did not throw";
  }
  return "";
}

TEST(Loader, AnErrorInThePrefetchThreadReachesTheConsumer) {
  // Find where sample 17 lands in the order (micro-batches of 2, dp = 1).
  GlobalOrder order(40, 7, 4);
  KeyedPermutation perm = order.order(0);
  int64_t position = 0;
  while (perm(static_cast<uint64_t>(position)) != 17) ++position;
  FakeSource poisoned(40, 2, 17);
  const int good = static_cast<int>(position / 2);
  for (int prefetch : {0, 1, 2, 5}) {
    EXPECT_EQ(error_after(poisoned, options(4, 2, 0, 1, prefetch), good),
              "data file 'fake.bin': sample 17 is unreadable")
        << "prefetch " << prefetch;
  }
  // A loader destroyed while its producer waits for a free slot shuts down cleanly.
  FakeSource fine(40, 2);
  for (int i = 0; i < 20; ++i) {
    DataLoader loader(fine, options(4, 2, 0, 1, 3));
    if (i % 2 == 0) loader.next();
  }
}

TEST(Loader, BadSplitsAreClearErrors) {
  FakeSource source(40, 2);
  auto message = [&](const LoaderOptions& o) -> std::string {
    try {
      DataLoader loader(source, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message(options(10, 1, 0, 4)),
            "data: train.batch_size (10) must be divisible by the data-parallel size dp = 4");
  EXPECT_EQ(message(options(12, 4, 0, 2)),
            "data: train.batch_size (12) / dp (2) = 6 sequences per rank must be a multiple of "
            "train.micro_batch_size (4)");
  EXPECT_EQ(message(options(64, 8, 0, 1)),
            "data: 40 training samples, fewer than one global batch of train.batch_size = 64");
  EXPECT_NE(message(options(8, 1, 2, 2)).find("rank 2 out of range"), std::string::npos);
  EXPECT_EQ(message(options(8, 1, 1, 2)), "");
}

TEST(Validation, IsTheLeadingWindowsInOrderSplitLikeTraining) {
  FakeSource source(20, 2);
  const int64_t global = 8, batches = 3;  // 24 windows: 20, then 0..3 again
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < global * batches; ++i) expected.push_back(i % 20);
  for (int64_t dp : {1, 2, 4}) {
    std::vector<std::vector<int64_t>> per_rank(static_cast<size_t>(dp));
    for (int64_t r = 0; r < dp; ++r) {
      ValidationSet val(source, options(global, 2, r, dp), batches);
      EXPECT_EQ(val.num_micro_batches(), batches * global / dp / 2);
      MicroBatch b, again;
      for (int64_t k = 0; k < val.num_micro_batches(); ++k) {
        val.read(k, b);
        val.read(k, again);  // fixed: the same every time
        EXPECT_EQ(b.samples, again.samples);
        EXPECT_EQ(b.inputs, again.inputs);
        EXPECT_EQ(b.inputs[0], b.samples[0] * 100);
        per_rank[static_cast<size_t>(r)].insert(per_rank[static_cast<size_t>(r)].end(), b.samples.begin(), b.samples.end());
      }
    }
    // Batch by batch, the ranks' shares in rank order are the windows in file order.
    std::vector<int64_t> joined;
    const int64_t share = global / dp;
    for (int64_t batch = 0; batch < batches; ++batch) {
      for (int64_t r = 0; r < dp; ++r) {
        auto& mine = per_rank[static_cast<size_t>(r)];
        joined.insert(joined.end(), mine.begin() + batch * share, mine.begin() + (batch + 1) * share);
      }
    }
    EXPECT_EQ(joined, expected) << "dp " << dp;
  }
  ValidationSet val(source, options(global, 2, 0, 1), batches);
  MicroBatch b;
  EXPECT_THROW(val.read(val.num_micro_batches(), b), Error);
}

}  // namespace
}  // namespace meshtrain
