#include "meshtrain/plan/transformer.h"

namespace meshtrain::plan {

TransformerCounts count_transformer(const ModelConfig& c) {
  const double d = static_cast<double>(c.dim), f = static_cast<double>(c.hidden_dim);
  const double q = static_cast<double>(c.n_heads * c.head_dim());
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim());
  const double vocab = static_cast<double>(c.vocab_size);
  TransformerCounts n;
  if (c.family == Family::llama) {
    n.layer_matmul_params = d * q + 2 * d * kv + q * d + 3 * d * f;  // q,k,v,o; gate, up, down
    n.layer_params = n.layer_matmul_params + 2 * d;                  // two RMSNorm weights
    n.embedding_params = vocab * d;
    n.head_params = d + (c.tie_embeddings ? 0 : vocab * d);
  } else {
    n.layer_matmul_params = 3 * d * d + d * d + 2 * d * f;  // c_attn, c_proj, c_fc, c_proj
    n.layer_params = n.layer_matmul_params + 4 * d          // two LayerNorms (weight, bias)
                     + 3 * d + d + f + d;                   // the four linear biases
    n.embedding_params = vocab * d + static_cast<double>(c.max_seq_len) * d;
    n.head_params = 2 * d;
  }
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
