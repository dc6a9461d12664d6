// What the harnesses that need a model share: one CPU context (oneDNN's engine
// is costly to make per input) and a tiny Llama shape.
#pragma once

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/model/config.h"
#include "meshtrain/tensor/memory_tracker.h"

namespace meshtrain::fuzz {

// dim 8, 2 heads (1 kv head), SwiGLU 16, vocabulary 16, 8 positions.
inline ModelConfig tiny_llama(int64_t layers, bool tied) {
  ModelConfig c;
  c.family = Family::llama;
  c.dim = 8;
  c.n_layers = layers;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.hidden_dim = 16;
  c.vocab_size = 16;
  c.max_seq_len = 8;
  c.tie_embeddings = tied;
  return c;
}

inline cpu::CpuBackend& cpu_context() {
  static MemoryTracker tracker;
  static cpu::CpuBackend ctx(1, tracker);
  return ctx;
}

}  // namespace meshtrain::fuzz
