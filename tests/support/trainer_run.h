// Whole Trainer runs on a tiny corpus, shared by the training, DDP, ZeRO and
// pipeline tests: the corpus, a config from a test's TOML plus overrides, and a run.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::testing {

// A learnable stream of `count` ids below `vocab`: a short repeating phrase,
// shifted by one every `shift_every` tokens (0: never) so it is not periodic.
inline std::vector<uint16_t> phrase_tokens(int count, int vocab, int shift_every = 997) {
  const char* text = "in the beginning was the word, and the word was with god. ";
  std::vector<uint16_t> tokens;
  for (int i = 0; i < count; ++i) {
    const int shift = shift_every > 0 ? i / shift_every : 0;
    tokens.push_back(static_cast<uint16_t>((text[i % std::strlen(text)] - 32 + shift) % vocab));
  }
  return tokens;
}

// dir/train.bin (4000 phrase tokens) and dir/val.bin (its first 800).
inline void write_phrase_corpus(const std::string& dir, int vocab) {
  const std::vector<uint16_t> tokens = phrase_tokens(4000, vocab);
  write_token_file(dir + "/train.bin", tokens);
  write_token_file(dir + "/val.bin", std::vector<uint16_t>(tokens.begin(), tokens.begin() + 800));
}

// The end of a quiet test run's [train] table (one thread, no evaluation, no
// checkpoints, a fixed FLOP/s peak) and its [data] table of byte tokens, for
// tiny_run_config.
inline constexpr const char* kQuietRunTail = R"(threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
[data]
tokenizer = "bytes"
)";

// `toml` (ending in its [data] table) with dir/train.bin and dir/val.bin as
// the data and dir/out as train.out_dir, then `extra`; `name` for errors.
inline TrainConfig tiny_run_config(std::string toml, const std::string& dir,
                                   const std::string& out, ConfigOverrides extra,
                                   const std::string& name) {
  toml += "train = \"" + dir + "/train.bin\"\nval = \"" + dir + "/val.bin\"\n";
  extra.insert(extra.begin(), {"train.out_dir", dir + "/" + out});
  return parse_config(toml, name, extra);
}

// The memory-plan tests' run: 3 layers of `family` (llama: grouped-query
// attention, untied, bf16; gpt2: tied, fp32), 2 steps of 2 micro-batches of 2
// x 16 byte tokens of `dir`'s corpus, one thread, output under dir/out.
inline TrainConfig memory_plan_config(const std::string& dir, const std::string& family,
                                      ConfigOverrides extra = {}) {
  const bool llama = family == "llama";
  return tiny_run_config(fmt::format(R"(
[model]
family = "{}"
dim = 32
n_layers = 3
n_heads = 4
n_kv_heads = {}
hidden_dim = 48
vocab_size = 64
max_seq_len = 32
tie_embeddings = {}
[train]
precision = "{}"
steps = 2
batch_size = 4
micro_batch_size = 2
seq_len = 16
{})",
                                     family, llama ? 2 : 4, llama ? "false" : "true",
                                     llama ? "bf16" : "fp32", kQuietRunTail),
                         dir, "out", std::move(extra), "memory_plan.toml");
}

struct TrainerRun {
  std::vector<StepRecord> records;
  std::vector<float> weights;  // the master weights after the run, full layout
  double val_loss = 0;         // after the run, when asked for
  MemorySnapshot memory;       // the tracker after the run (peaks by category)
  RankMemory predicted;        // this rank's prediction (train/memory_plan.h)
};

// A quiet run on `mesh` (nullptr: one process), resumed from `resume` if set;
// `evaluate`: also the validation loss after the last step;
// `allow_config_change`: resume although the settings changed.
inline TrainerRun run_trainer(const TrainConfig& c, DeviceMesh* mesh = nullptr,
                              const std::string& resume = "", bool evaluate = false,
                              bool allow_config_change = false) {
  TrainerOptions options;
  options.allow_config_change = allow_config_change;
  options.console = false;
  options.mesh = mesh;
  options.resume_dir = resume;
  Trainer trainer(c, options);
  TrainerRun r;
  r.records = trainer.run();
  if (evaluate) r.val_loss = trainer.evaluate();
  // Before gathering: the gather's buffers are not the run's.
  r.memory = trainer.tracker().snapshot();
  r.predicted = trainer.memory_plan().at(mesh != nullptr ? static_cast<size_t>(mesh->rank()) : 0);
  r.weights = trainer.gather_weights();
  return r;
}

// How close a layout's run must be to the one-rank reference: relative
// loss and gradient norm, absolute final weights (fp32 defaults).
struct RunTolerance {
  double loss = 1e-5, grad_norm = 1e-4;
  float weight = 1e-5f;
};

// Every step's loss and gradient norm, and the final weights, of `got`
// against `ref`; prints "[tag] what: ..." with the largest weight difference
// when `print` (rank 0).
inline void expect_runs_close(const TrainerRun& got, const TrainerRun& ref, const std::string& what,
                              RunTolerance tol, const std::string& tag, bool print) {
  ASSERT_EQ(got.records.size(), ref.records.size()) << what;
  for (size_t i = 0; i < ref.records.size(); ++i) {
    EXPECT_NEAR(got.records[i].loss, ref.records[i].loss, tol.loss * std::fabs(ref.records[i].loss))
        << what << ": step " << i + 1;
    // AdamW hides a gradient's scale from the weights; the norm does not.
    EXPECT_NEAR(got.records[i].grad_norm, ref.records[i].grad_norm,
                tol.grad_norm * ref.records[i].grad_norm)
        << what << ": gradient norm, step " << i + 1;
    EXPECT_EQ(got.records[i].loss_tokens, ref.records[i].loss_tokens) << what;
  }
  ASSERT_EQ(got.weights.size(), ref.weights.size()) << what;
  float worst = 0;
  for (size_t i = 0; i < ref.weights.size(); ++i) {
    worst = std::max(worst, std::fabs(got.weights[i] - ref.weights[i]));
  }
  EXPECT_LE(worst, tol.weight) << what << ": largest weight difference";
  if (print) {
    std::printf("[%s] %s: final loss %.6f (one rank %.6f), largest weight difference %.2e\n",
                tag.c_str(), what.c_str(), got.records.back().loss, ref.records.back().loss,
                static_cast<double>(worst));
  }
}

}  // namespace meshtrain::testing
