#include "meshtrain/plan/transformer.h"

#include <cmath>

namespace meshtrain::plan {

TransformerCounts count_transformer(const ModelConfig& c) {
  const double d = static_cast<double>(c.dim), f = static_cast<double>(c.hidden_dim);
  const double q = static_cast<double>(c.n_heads * c.head_dim());
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim());
  const double vocab = static_cast<double>(c.vocab_size);
  TransformerCounts n;
  // From the recipe: q, k, v, o; the feed-forward's input (gate and up, or
  // fc) and output; each norm's weight (and bias); the linear biases; the
  // learned position table; the final norm and an untied output layer.
  const Recipe& r = c.recipe();
  const double ff_in = static_cast<double>(r.ff_in_factor()) * f;
  const double norm = (r.norm == NormKind::layer ? 2 : 1) * d;  // weight (+ bias)
  const double attention = d * q + 2 * d * kv + q * d;
  double mlp = d * ff_in + f * d, mlp_params = mlp;
  if (const MoeConfig& m = c.moe; m.enabled()) {
    // Per MoE layer: the router [E, d], the experts [E, 3 I, d] (top_k of them
    // per token), the shared experts [3 Is, d] and their gate [1, d], the
    // selection bias [E] (not a GEMM); averaged with the dense layers.
    const double layers = static_cast<double>(c.n_layers);
    for (int64_t i = 0; i < c.n_layers; ++i) n.moe_layers += m.is_moe_layer(i) ? 1 : 0;
    const double dense = layers - n.moe_layers, E = static_cast<double>(m.experts);
    const double experts = E * 3 * d * static_cast<double>(m.hidden_dim);
    const double shared = 3 * d * static_cast<double>(m.shared_hidden) + (m.shared_gate ? d : 0);
    const double active = d * E + experts * static_cast<double>(m.top_k) / E + shared;
    n.layer_expert_params = n.moe_layers * experts / layers;
    mlp = (dense * mlp + n.moe_layers * active) / layers;
    mlp_params = (dense * mlp_params +
                  n.moe_layers * (d * E + experts + shared + (m.bias_update_rate > 0 ? E : 0))) /
                 layers;
  }
  n.layer_matmul_params = attention + mlp;
  n.layer_params = attention + mlp_params + 2 * norm + c.qk_norm_sizes(q, kv).weights +
                   (c.qkv_bias ? q + 2 * kv : 0) +
                   (r.linear_bias ? q + 2 * kv + d + ff_in + d : 0);
  n.embedding_params =
      vocab * d + (r.positions == Positions::learned ? static_cast<double>(c.max_seq_len) * d : 0);
  n.head_params = norm + (c.tied_output() ? 0 : vocab * d);
  n.output_matmul_params = vocab * d;
  n.total_params = static_cast<double>(c.n_layers) * n.layer_params + n.embedding_params +
                   n.head_params;
  return n;
}

double active_mlp_width(const ModelConfig& c) {
  const MoeConfig& m = c.moe;
  if (!m.enabled()) return static_cast<double>(c.hidden_dim);
  double width = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    width += static_cast<double>(m.is_moe_layer(i) ? m.top_k * m.hidden_dim + m.shared_hidden
                                                   : c.hidden_dim);
  }
  return width / static_cast<double>(c.n_layers);
}

ModelConfig active_dense_view(const ModelConfig& c) {
  if (!c.moe.enabled()) return c;
  ModelConfig view = c;
  view.moe = MoeConfig{};
  view.hidden_dim = static_cast<int64_t>(std::llround(active_mlp_width(c)));
  return view;
}

double layer_train_flops_per_token(const ModelConfig& c, int64_t seq) {
  const double attention = 12.0 * static_cast<double>(seq) *
                           static_cast<double>(c.n_heads * c.head_dim());
  return 6.0 * count_transformer(c).layer_matmul_params + attention;
}

double output_train_flops_per_token(const ModelConfig& c) {
  return 6.0 * count_transformer(c).output_matmul_params;
}

}  // namespace meshtrain::plan
