// Closed-form counts of a decoder's parameters and FLOPs from its ModelConfig,
// per layer and for the embedding / output ends, so a pipeline stage's share
// can be computed without building the parameter registry (the search
// evaluates ~10^5 layouts). Tests check them against build_param_specs.
#pragma once

#include <cstdint>

#include "meshtrain/model/config.h"

namespace meshtrain::plan {

struct TransformerCounts {
  double layer_params = 0;         // one block: norms, attention, MLP (and biases)
  double layer_matmul_params = 0;  // the block's GEMM weights
  double embedding_params = 0;     // token (+ learned position) embeddings
  double head_params = 0;          // final norm + untied output layer
  double output_matmul_params = 0; // the output layer's GEMM weights (tied: the embedding)
  double total_params = 0;         // == ModelConfig::num_params()
};
TransformerCounts count_transformer(const ModelConfig& config);

// Training FLOPs per token (forward + backward = 3x forward, 2 FLOPs per MAC),
// PaLM's convention: 6 x GEMM weights + 12 x seq x (heads x head_dim) per layer
// for the attention scores and the weighted sum (no causal discount).
double layer_train_flops_per_token(const ModelConfig& config, int64_t seq);
double output_train_flops_per_token(const ModelConfig& config);

}  // namespace meshtrain::plan
