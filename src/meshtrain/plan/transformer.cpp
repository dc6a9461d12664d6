#include "meshtrain/plan/transformer.h"

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
  n.layer_matmul_params = d * q + 2 * d * kv + q * d + d * ff_in + f * d;
  n.layer_params = n.layer_matmul_params + 2 * norm + (r.linear_bias ? q + 2 * kv + d + ff_in + d : 0);
  n.embedding_params =
      vocab * d + (r.positions == Positions::learned ? static_cast<double>(c.max_seq_len) * d : 0);
  n.head_params = norm + (c.tied_output() ? 0 : vocab * d);
  n.output_matmul_params = vocab * d;
  n.total_params = static_cast<double>(c.n_layers) * n.layer_params + n.embedding_params +
                   n.head_params;
  return n;
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
