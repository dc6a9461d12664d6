// Closed-form counts of a decoder's parameters and FLOPs from its ModelConfig,
// per layer and for the embedding / output ends, so a pipeline stage's share
// can be computed without building the parameter registry (the search
// evaluates ~10^5 layouts). Tests check them against build_param_specs.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/model/config.h"

namespace meshtrain::plan {

// The attention of one layer as the planner prices it: grouped-query
// attention from the heads, or DeepSeek's latent attention (ModelConfig::mla)
// from its ranks. Widths are per token, summed over the heads.
struct AttentionShape {
  // How tensor parallelism cuts a projection: its output (column parallel),
  // its input (row parallel), or not at all (MLA's low-rank down-projections).
  enum class Split : uint8_t { none, out, in };
  struct Projection {
    const char* name;
    double in, out;
    Split split;
    // MLA's q_b and kv_b: recomputable from the kept latents (selective
    // recomputation does, so Q, K and V are not kept; DeepSeek-V3 3.2.3).
    bool from_latent = false;
  };
  std::vector<Projection> in;  // x -> q, k, v: "qkv", or q_a, q_b, kv_a, kv_b
  Projection out;              // "o-proj": values -> dim
  double heads = 0;
  double qk = 0;       // the queries' width: the scores' inner dimension times heads
  double k = 0, v = 0; // the keys' and values' widths as attention reads them (kept, gathered)
  double rope = 0;     // the q and k values RoPE rotates
  // MLA: the latent RMSNorms' weights, and the values each token keeps for
  // their backward that tp does not split (the latents before and after the norm).
  double norm_weights = 0, latent = 0;
  // Of qk + k + v, the widths the from_latent projections write: what
  // selective recomputation does not keep.
  double from_latent = 0;
  // The o-projection's input: heads x the value head width.
  double values() const { return out.in; }
};
AttentionShape attention_shape(const ModelConfig& config);

// A mixture of experts (moe.experts > 0) is counted per layer as the average
// over its layers (dense and MoE ones): exact for the totals and the FLOPs,
// and for a model whose every layer is MoE (Mixtral) exact per layer too.
struct TransformerCounts {
  double layer_params = 0;         // one block: norms, attention, MLP (and biases)
  // The block's GEMM weights a token uses: a MoE layer's router, top_k of its
  // E routed experts, its shared experts and their gate.
  double layer_matmul_params = 0;
  // Of layer_params, the routed experts' (all E; split over ep, never over tp).
  double layer_expert_params = 0;
  double moe_layers = 0;           // how many of the layers route (0: dense)
  double embedding_params = 0;     // token (+ learned position) embeddings
  double head_params = 0;          // final norm + untied output layer
  double output_matmul_params = 0; // the output layer's GEMM weights (tied: the embedding)
  double total_params = 0;         // == ModelConfig::num_params()
};
TransformerCounts count_transformer(const ModelConfig& config);

// The dense model a token sees: a MoE model's feed-forward replaced by one of
// the width a token runs through (top_k experts + the shared ones, averaged
// over the layers); the model itself when dense. The planner's per-op compute
// and activation memory read this width (docs/plan.md, "Mixtures of experts").
ModelConfig active_dense_view(const ModelConfig& config);
// That width: hidden_dim when dense.
double active_mlp_width(const ModelConfig& config);

// Training FLOPs per token (forward + backward = 3x forward, 2 FLOPs per MAC),
// PaLM's convention: 6 x GEMM weights + 6 x seq x (qk + values) per layer for
// the attention scores and the weighted sum (no causal discount; 12 x seq x
// heads x head_dim when queries and values are as wide).
double layer_train_flops_per_token(const ModelConfig& config, int64_t seq);
double output_train_flops_per_token(const ModelConfig& config);

}  // namespace meshtrain::plan
