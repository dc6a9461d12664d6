// Tiny model shapes and inputs shared by the model tests.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/model/model.h"
#include "meshtrain/util/rng.h"

namespace meshtrain::testing {

// Llama with grouped-query attention (4 query heads over 2 kv heads).
inline ModelConfig tiny_llama(bool tied) {
  ModelConfig c;
  c.family = Family::llama;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.hidden_dim = 24;
  c.vocab_size = 32;
  c.max_seq_len = 16;
  c.rope_theta = 100.0f;  // angles far from 0 within a few positions
  c.tie_embeddings = tied;
  c.init_std = 0.3f;      // large enough that the nonlinearities matter
  return c;
}

inline ModelConfig tiny_gpt2() {
  ModelConfig c;
  c.family = Family::gpt2;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.hidden_dim = 32;
  c.vocab_size = 32;
  c.max_seq_len = 16;
  c.tie_embeddings = true;
  c.init_std = 0.3f;
  return c;
}

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

}  // namespace meshtrain::testing
