// A decoder-only transformer (Llama or GPT-2 family) with explicit forward and
// backward passes on the CPU backend.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "meshtrain/backend/cpu/attention.h"
#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/model/config.h"
#include "meshtrain/model/params.h"

namespace meshtrain {

// Per-sequence state for incremental decoding.
struct KVCache {
  int64_t batch = 0, max_seq = 0, length = 0;
  std::vector<cpu::KVCacheLayer> layers;
};

class Model {
 public:
  Model(const ModelConfig& config, Precision precision, cpu::CpuContext& ctx);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  Precision precision() const { return precision_; }
  cpu::CpuContext& ctx() { return ctx_; }

  // Registry order: embeddings, then per layer, then final norm and (untied) output.
  std::vector<Parameter>& params() { return params_; }
  const std::vector<Parameter>& params() const { return params_; }
  const Parameter& param(const std::string& name) const;  // throws Error if unknown
  Parameter& param(const std::string& name);
  Tensor& flat_master() { return flat_master_; }
  Tensor& flat_grad() { return flat_grad_; }
  int64_t num_params() const { return flat_master_.numel(); }

  // Layout-independent initialisation from the seed.
  void init_weights(uint64_t seed);
  // Refreshes the bf16 compute copies from the f32 master weights (no-op for fp32).
  // Call after changing master weights by hand (load, init); the optimizer
  // writes the copies itself.
  void sync_compute_weights();
  void zero_grads();

  // One micro-batch: tokens/targets [batch * seq]. Gradients are ADDED to the
  // grad buffer, each token's loss weighted by grad_scale (so grad_scale =
  // 1 / tokens-in-the-optimizer-step gives the mean over the step).
  // Returns the sum of the token losses.
  double forward_backward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                          int64_t seq, float grad_scale);
  // Forward only: sum of token losses (evaluation).
  double forward_loss(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq);
  // Forward only: full logits [batch * seq, vocab] f32 (tests, small inputs).
  void forward_logits(const int32_t* tokens, int64_t batch, int64_t seq, float* logits);

  // Called during backward, in reverse registry order, when a parameter's
  // gradient for this micro-batch is complete (used by data parallelism).
  std::function<void(size_t param_index)> on_grad_ready;

  // Incremental decoding with a KV cache.
  KVCache make_kv_cache(int64_t batch, int64_t max_seq);
  // Runs tokens [batch, n_new] at positions [cache.length, cache.length + n_new),
  // appends to the cache and writes the last position's logits [batch, vocab].
  void decode(const int32_t* tokens, int64_t batch, int64_t n_new, KVCache& cache,
              float* last_logits);

 private:
  struct Impl;  // layers and saved activations, in model.cpp
  ModelConfig config_;
  Precision precision_;
  cpu::CpuContext& ctx_;
  std::vector<Parameter> params_;
  Tensor flat_master_, flat_grad_, flat_compute_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain
