// Tiny model shapes, a model on its own CPU context, and deterministic inputs,
// shared by the model, checkpoint, parity and training tests.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/model/model.h"
#include "meshtrain/util/rng.h"

namespace meshtrain::testing {

// What differs between the tiny shapes; all of them have dim 16, 2 layers and
// init std 0.3 (large enough that the nonlinearities matter).
struct TinyShape {
  int64_t n_heads;
  int64_t n_kv_heads;
  int64_t hidden_dim;
  int64_t vocab_size;
  int64_t max_seq_len;
  bool tied;
};

inline ModelConfig tiny_config(Family family, const TinyShape& s) {
  ModelConfig c;
  c.family = family;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = s.n_heads;
  c.n_kv_heads = s.n_kv_heads;
  c.hidden_dim = s.hidden_dim;
  c.vocab_size = s.vocab_size;
  c.max_seq_len = s.max_seq_len;
  c.tie_embeddings = s.tied;
  c.init_std = 0.3f;
  return c;
}

// Model tests. Llama with grouped-query attention (4 query heads over 2 kv heads).
inline ModelConfig tiny_llama(bool tied) {
  ModelConfig c = tiny_config(Family::llama, {.n_heads = 4, .n_kv_heads = 2, .hidden_dim = 24,
                                              .vocab_size = 32, .max_seq_len = 16, .tied = tied});
  c.rope_theta = 100.0f;  // angles far from 0 within a few positions
  return c;
}

inline ModelConfig tiny_gpt2() {
  return tiny_config(Family::gpt2, {.n_heads = 4, .n_kv_heads = 4, .hidden_dim = 32,
                                    .vocab_size = 32, .max_seq_len = 16, .tied = true});
}

// Checkpoint tests: an odd vocabulary and the default rope_theta (which llama2.c
// files require); the byte layouts they check are written for these shapes.
inline ModelConfig small_llama(bool tied) {
  return tiny_config(Family::llama, {.n_heads = 4, .n_kv_heads = 2, .hidden_dim = 24,
                                     .vocab_size = 19, .max_seq_len = 8, .tied = tied});
}

inline ModelConfig small_gpt2() {
  return tiny_config(Family::gpt2, {.n_heads = 2, .n_kv_heads = 2, .hidden_dim = 64,
                                    .vocab_size = 19, .max_seq_len = 8, .tied = true});
}

// A model with the tracker and CPU context it needs (which must outlive it).
struct CpuModel {
  CpuModel(const ModelConfig& config, Precision precision, int threads = 2)
      : ctx(threads, tracker), model(config, precision, ctx) {}
  MemoryTracker tracker;
  cpu::CpuBackend ctx;
  Model model;
};

// Initialises from `seed`, then moves norm weights and biases off their
// ones/zeros so that their paths are exercised too.
inline void init_for_test(Model& model, uint64_t seed) {
  model.init_weights(seed);
  const uint64_t key = stream_key(seed, "test-perturbation");
  for (Parameter& p : model.params()) {
    if (p.spec.init == InitKind::normal) continue;
    float* v = p.master.data<float>();
    for (int64_t i = 0; i < p.spec.numel(); ++i) {
      v[i] += 0.2f * normal_at(key, static_cast<uint64_t>(p.offset + i));
    }
  }
  model.sync_compute_weights();
}

inline std::vector<int32_t> random_ids(uint64_t seed, int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  const uint64_t key = stream_key(seed, "test-ids");
  for (int64_t i = 0; i < n; ++i) {
    ids[static_cast<size_t>(i)] =
        static_cast<int32_t>(uniform_at(key, static_cast<uint64_t>(i)) * static_cast<float>(vocab));
  }
  return ids;
}

// Rows [row0, row0 + rows) of step's global batch (`global_rows` random rows
// of seq + 1 ids) as inputs and targets: ranks that split the rows train on
// the single-rank run's batch.
inline void global_batch_rows(int step, int64_t global_rows, int64_t seq, int64_t vocab,
                              int64_t row0, int64_t rows, std::vector<int32_t>& inputs,
                              std::vector<int32_t>& targets) {
  const std::vector<int32_t> ids =
      random_ids(1000 + static_cast<uint64_t>(step), global_rows * (seq + 1), vocab);
  inputs.clear();
  targets.clear();
  for (int64_t r = row0; r < row0 + rows; ++r) {
    const int32_t* row = ids.data() + r * (seq + 1);
    inputs.insert(inputs.end(), row, row + seq);
    targets.insert(targets.end(), row + 1, row + 1 + seq);
  }
}

}  // namespace meshtrain::testing
