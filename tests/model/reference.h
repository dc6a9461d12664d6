// A float64 reference of both model families, written straight from the math
// (naive loops, no shared code with the engine), for tiny shapes in tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "meshtrain/model/model.h"

namespace meshtrain::testing {

using Weights = std::map<std::string, std::vector<double>>;

inline Weights weights_of(const Model& model) {
  Weights w;
  for (const Parameter& p : model.params()) {
    const float* v = p.master.data<float>();
    w[p.spec.name] = std::vector<double>(v, v + p.spec.numel());
  }
  return w;
}

namespace detail {

using Mat = std::vector<double>;  // row-major

// y[n, out] = x[n, in] · W^T with W [out, in] (nn.Linear) or x · W with W [in, out] (Conv1D).
inline Mat linear(const Mat& x, int64_t n, int64_t in, const Mat& w, int64_t out, bool nn_linear,
                  const Mat* bias = nullptr) {
  Mat y(static_cast<size_t>(n * out), 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = bias ? (*bias)[o] : 0.0;
      for (int64_t i = 0; i < in; ++i)
        s += x[r * in + i] * (nn_linear ? w[o * in + i] : w[i * out + o]);
      y[r * out + o] = s;
    }
  return y;
}

inline Mat rmsnorm(const Mat& x, int64_t n, int64_t d, const Mat& w, double eps) {
  Mat y(x.size());
  for (int64_t r = 0; r < n; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += x[r * d + i] * x[r * d + i];
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = x[r * d + i] * rstd * w[i];
  }
  return y;
}

inline Mat layernorm(const Mat& x, int64_t n, int64_t d, const Mat& w, const Mat& b, double eps) {
  Mat y(x.size());
  for (int64_t r = 0; r < n; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < d; ++i) mean += x[r * d + i];
    mean /= static_cast<double>(d);
    for (int64_t i = 0; i < d; ++i) var += (x[r * d + i] - mean) * (x[r * d + i] - mean);
    const double rstd = 1.0 / std::sqrt(var / static_cast<double>(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = (x[r * d + i] - mean) * rstd * w[i] + b[i];
  }
  return y;
}

}  // namespace detail

// Logits [batch * seq, vocab] of the model described by (config, weights).
inline std::vector<double> reference_logits(const ModelConfig& c, const Weights& w,
                                            const std::vector<int32_t>& tokens, int64_t batch,
                                            int64_t seq) {
  using namespace detail;
  const bool llama = c.family == Family::llama;
  const int64_t d = c.dim, H = c.n_heads, KV = c.n_kv_heads, D = c.head_dim(), hid = c.hidden_dim;
  const int64_t n = batch * seq, V = c.vocab_size;
  auto W = [&](const std::string& name) -> const Mat& { return w.at(name); };
  Mat x(static_cast<size_t>(n * d));
  const Mat& emb = W(llama ? "model.embed_tokens.weight" : "transformer.wte.weight");
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) {
      x[r * d + i] = emb[tokens[r] * d + i];
      if (!llama) x[r * d + i] += W("transformer.wpe.weight")[(r % seq) * d + i];
    }
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = llama ? "model.layers." + std::to_string(l) + "."
                                : "transformer.h." + std::to_string(l) + ".";
    Mat xn = llama ? rmsnorm(x, n, d, W(p + "input_layernorm.weight"), c.norm_eps)
                   : layernorm(x, n, d, W(p + "ln_1.weight"), W(p + "ln_1.bias"), c.norm_eps);
    Mat q, k, v;
    if (llama) {
      q = linear(xn, n, d, W(p + "self_attn.q_proj.weight"), H * D, true);
      k = linear(xn, n, d, W(p + "self_attn.k_proj.weight"), KV * D, true);
      v = linear(xn, n, d, W(p + "self_attn.v_proj.weight"), KV * D, true);
      // RoPE over interleaved pairs, angle = pos * theta^(-2i/D).
      auto rotate = [&](Mat& m, int64_t heads) {
        for (int64_t r = 0; r < n; ++r)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < D / 2; ++i) {
              const double angle = static_cast<double>(r % seq) *
                                   std::pow(static_cast<double>(c.rope_theta),
                                            -2.0 * static_cast<double>(i) / static_cast<double>(D));
              double& a = m[(r * heads + h) * D + 2 * i];
              double& b = m[(r * heads + h) * D + 2 * i + 1];
              const double a0 = a, b0 = b;
              a = a0 * std::cos(angle) - b0 * std::sin(angle);
              b = a0 * std::sin(angle) + b0 * std::cos(angle);
            }
      };
      rotate(q, H);
      rotate(k, KV);
    } else {
      Mat qkv = linear(xn, n, d, W(p + "attn.c_attn.weight"), 3 * d, false,
                       &W(p + "attn.c_attn.bias"));
      q.resize(static_cast<size_t>(n * d));
      k = q;
      v = q;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < d; ++i) {
          q[r * d + i] = qkv[r * 3 * d + i];
          k[r * d + i] = qkv[r * 3 * d + d + i];
          v[r * d + i] = qkv[r * 3 * d + 2 * d + i];
        }
    }
    // Causal attention; query head h reads kv head h / (H / KV).
    Mat att(static_cast<size_t>(n * H * D), 0.0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t j = h / (H / KV);
        for (int64_t t = 0; t < seq; ++t) {
          std::vector<double> s(static_cast<size_t>(t + 1));
          double mx = -1e300, sum = 0;
          for (int64_t u = 0; u <= t; ++u) {
            double dot = 0;
            for (int64_t e = 0; e < D; ++e)
              dot += q[((b * seq + t) * H + h) * D + e] * k[((b * seq + u) * KV + j) * D + e];
            s[u] = dot * scale;
            mx = std::max(mx, s[u]);
          }
          for (double& e : s) sum += (e = std::exp(e - mx));
          for (int64_t u = 0; u <= t; ++u)
            for (int64_t e = 0; e < D; ++e)
              att[((b * seq + t) * H + h) * D + e] +=
                  s[u] / sum * v[((b * seq + u) * KV + j) * D + e];
        }
      }
    Mat o = llama ? linear(att, n, H * D, W(p + "self_attn.o_proj.weight"), d, true)
                  : linear(att, n, d, W(p + "attn.c_proj.weight"), d, false,
                           &W(p + "attn.c_proj.bias"));
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    xn = llama ? rmsnorm(x, n, d, W(p + "post_attention_layernorm.weight"), c.norm_eps)
               : layernorm(x, n, d, W(p + "ln_2.weight"), W(p + "ln_2.bias"), c.norm_eps);
    Mat f;
    if (llama) {
      Mat g = linear(xn, n, d, W(p + "mlp.gate_proj.weight"), hid, true);
      Mat u = linear(xn, n, d, W(p + "mlp.up_proj.weight"), hid, true);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      f = linear(g, n, hid, W(p + "mlp.down_proj.weight"), d, true);
    } else {
      Mat h = linear(xn, n, d, W(p + "mlp.c_fc.weight"), hid, false, &W(p + "mlp.c_fc.bias"));
      for (double& e : h) {
        e = 0.5 * e * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (e + 0.044715 * e * e * e)));
      }
      f = linear(h, n, hid, W(p + "mlp.c_proj.weight"), d, false, &W(p + "mlp.c_proj.bias"));
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += f[i];
  }
  Mat hn = llama ? rmsnorm(x, n, d, W("model.norm.weight"), c.norm_eps)
                 : layernorm(x, n, d, W("transformer.ln_f.weight"), W("transformer.ln_f.bias"),
                             c.norm_eps);
  const Mat& out = llama && !c.tie_embeddings ? W("lm_head.weight") : emb;
  return linear(hn, n, d, out, V, true);
}

// Sum over rows with target >= 0 of -log softmax(logits)[target].
inline double reference_loss(const std::vector<double>& logits, const std::vector<int32_t>& targets,
                             int64_t vocab) {
  double total = 0;
  for (size_t r = 0; r < targets.size(); ++r) {
    if (targets[r] < 0) continue;
    const double* row = logits.data() + r * static_cast<size_t>(vocab);
    double mx = row[0], sum = 0;
    for (int64_t v = 1; v < vocab; ++v) mx = std::max(mx, row[v]);
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
    total += std::log(sum) + mx - row[targets[r]];
  }
  return total;
}

}  // namespace meshtrain::testing
