#include "meshtrain/plan/transformer.h"

#include <cmath>

namespace meshtrain::plan {

AttentionShape attention_shape(const ModelConfig& c) {
  using Split = AttentionShape::Split;
  const double d = static_cast<double>(c.dim), heads = static_cast<double>(c.n_heads);
  const bool rope = c.recipe().positions == Positions::rope;
  AttentionShape a;
  a.heads = heads;
  if (const MlaConfig& m = c.mla; m.enabled()) {
    const auto width = [](int64_t n) { return static_cast<double>(n); };
    const double qh = width(m.nope_dim + m.rope_dim), qr = width(m.q_rank);
    const double kvr = width(m.kv_rank), rope_dim = width(m.rope_dim);
    if (m.q_rank > 0) {
      a.in = {{"q_a", d, qr, Split::none}, {"q_b", qr, heads * qh, Split::out, true}};
    } else {
      a.in = {{"q", d, heads * qh, Split::out}};
    }
    a.in.push_back({"kv_a", d, kvr + rope_dim, Split::none});
    a.in.push_back({"kv_b", kvr, heads * width(m.nope_dim + m.v_dim), Split::out, true});
    a.out = {"o-proj", heads * width(m.v_dim), d, Split::in};
    a.qk = a.k = heads * qh;
    a.v = a.values();
    a.rope = heads * rope_dim + rope_dim;  // the shared k_rope once
    a.norm_weights = qr + kvr;
    a.latent = 2 * qr + 2 * kvr + rope_dim;  // q_a's and kv_a's outputs, the normed latents
    a.from_latent = (m.q_rank > 0 ? a.qk : 0) + a.k + a.v;
    return a;
  }
  const double q = static_cast<double>(c.attention_width());
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim());
  a.in = {{"qkv", d, q + 2 * kv, Split::out}};
  a.out = {"o-proj", q, d, Split::in};
  a.qk = q;
  a.k = a.v = kv;
  a.rope = rope ? q + kv : 0;
  return a;
}

TransformerCounts count_transformer(const ModelConfig& c) {
  const double d = static_cast<double>(c.dim), f = static_cast<double>(c.hidden_dim);
  const AttentionShape shape = attention_shape(c);
  const double q = shape.qk, kv = shape.k, qkv = shape.qk + shape.k + shape.v;
  const double vocab = static_cast<double>(c.vocab_size);
  TransformerCounts n;
  // From the recipe: q, k, v, o (MLA: its five projections and two norms); the feed-forward's input (gate and up, or
  // fc) and output; each norm's weight (and bias); the linear biases; the
  // learned position table; the final norm and an untied output layer.
  const Recipe& r = c.recipe();
  const double ff_in = static_cast<double>(r.ff_in_factor()) * f;
  const double norm = (r.norm == NormKind::layer ? 2 : 1) * d;  // weight (+ bias)
  double attention = shape.out.in * shape.out.out;
  for (const AttentionShape::Projection& p : shape.in) attention += p.in * p.out;
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
  n.layer_params = attention + mlp_params + 2 * norm + shape.norm_weights +
                   c.qk_norm_sizes(q, kv).weights + (c.qkv_bias ? qkv : 0) +
                   (r.linear_bias ? qkv + d + ff_in + d : 0);
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
  const AttentionShape a = attention_shape(c);
  const double attention = 6.0 * c.attention_seq(static_cast<double>(seq)) * (a.qk + a.values());
  return 6.0 * count_transformer(c).layer_matmul_params + attention;
}

double output_train_flops_per_token(const ModelConfig& c) {
  return 6.0 * count_transformer(c).output_matmul_params;
}

}  // namespace meshtrain::plan
