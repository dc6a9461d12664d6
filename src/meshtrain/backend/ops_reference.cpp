#include "meshtrain/backend/ops_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "meshtrain/tensor/nf4.h"

namespace meshtrain::ops::reference {
namespace {

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

constexpr double kGeluC0 = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluC1 = 0.044715;

// The angle of position p and pair i as the backends compute it: p * inv_freq in float.
double rope_angle(std::span<const float> inv_freq, int64_t p, int64_t i) {
  return static_cast<double>(static_cast<float>(p) * inv_freq[static_cast<size_t>(i)]);
}

// Rotates x[0, D) by position p (inverse: the transpose rotation).
void rotate(double* x, int64_t D, int64_t p, std::span<const float> inv_freq, bool inverse) {
  if (inv_freq.empty()) return;
  for (int64_t i = 0; i < D / 2; ++i) {
    const double a = rope_angle(inv_freq, p, i), c = std::cos(a),
                 s = (inverse ? -1 : 1) * std::sin(a);
    const double x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * c - x1 * s;
    x[2 * i + 1] = x0 * s + x1 * c;
  }
}

// Per (batch, head): the rotated q, k, v rows and the keys each query sees.
struct AttentionRows {
  int64_t B, T, H, KV, D, W;
  Vec q, k, v;                 // [B, T, H|KV, D]
  std::vector<int64_t> first;  // [B * T]: the first key of each query
  double scale;

  AttentionRows(const AttentionDims& d, std::span<const float> inv_freq, const Vec& qkv,
                int64_t pos0)
      : B(d.batch),
        T(d.seq),
        H(d.n_heads),
        KV(d.n_kv_heads),
        D(d.head_dim),
        W(d.qkv_width()),
        q(static_cast<size_t>(B * T * H * D)),
        k(static_cast<size_t>(B * T * KV * D)),
        v(k.size()),
        first(static_cast<size_t>(B * T)),
        scale(1.0 / std::sqrt(static_cast<double>(D))) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t pos = d.positions ? d.positions[b * T + t] : pos0 + t;
        // The record's first token, or the window's (its last `window` keys).
        const int64_t record = d.positions ? t - pos : 0;
        first[static_cast<size_t>(b * T + t)] =
            d.window > 0 ? std::max(record, t - d.window + 1) : record;
        const double* row = &qkv[static_cast<size_t>((b * T + t) * W)];
        for (int64_t h = 0; h < H; ++h) {
          double* dst = &q[static_cast<size_t>(((b * T + t) * H + h) * D)];
          std::copy(row + h * D, row + (h + 1) * D, dst);
          rotate(dst, D, pos, inv_freq, false);
        }
        for (int64_t h = 0; h < KV; ++h) {
          double* kd = &k[static_cast<size_t>(((b * T + t) * KV + h) * D)];
          std::copy(row + (H + h) * D, row + (H + h + 1) * D, kd);
          rotate(kd, D, pos, inv_freq, false);
          std::copy(row + (H + KV + h) * D, row + (H + KV + h + 1) * D,
                    &v[static_cast<size_t>(((b * T + t) * KV + h) * D)]);
        }
      }
    }
  }
  const double* qr(int64_t b, int64_t t, int64_t h) const {
    return &q[static_cast<size_t>(((b * T + t) * H + h) * D)];
  }
  const double* kr(int64_t b, int64_t s, int64_t h) const {
    return &k[static_cast<size_t>(((b * T + s) * KV + h) * D)];
  }
  const double* vr(int64_t b, int64_t s, int64_t h) const {
    return &v[static_cast<size_t>(((b * T + s) * KV + h) * D)];
  }

  // Softmax probabilities of query (b, t, h) over keys [first, t].
  Vec probs(int64_t b, int64_t t, int64_t h) const {
    const int64_t s0 = first[static_cast<size_t>(b * T + t)], kvh = h / (H / KV);
    Vec p(static_cast<size_t>(t - s0 + 1));
    double mx = -1e300, sum = 0;
    for (int64_t s = s0; s <= t; ++s) {
      double dot = 0;
      for (int64_t i = 0; i < D; ++i) dot += qr(b, t, h)[i] * kr(b, s, kvh)[i];
      p[static_cast<size_t>(s - s0)] = dot * scale;
      mx = std::max(mx, dot * scale);
    }
    for (double& x : p) sum += (x = std::exp(x - mx));
    for (double& x : p) x /= sum;
    return p;
  }
};

}  // namespace

void matmul(const MatmulDims& dims, std::span<const double> a, std::span<const double> b, Vec& c,
            double alpha, bool accumulate, const double* bias) {
  const int64_t M = dims.m, N = dims.n, K = dims.k;
  const int64_t lda = dims.lda ? dims.lda : (dims.trans_a ? M : K);
  const int64_t ldb = dims.ldb ? dims.ldb : (dims.trans_b ? K : N);
  const int64_t ldc = dims.ldc ? dims.ldc : N;
  for (int64_t bt = 0; bt < dims.batch; ++bt) {
    const double* A = a.data() + bt * M * K;
    const double* B = b.data() + (dims.broadcast_b ? 0 : bt * K * N);
    double* C = c.data() + bt * M * N;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double sum = 0;
        for (int64_t l = 0; l < K; ++l) {
          const double x = dims.trans_a ? A[l * lda + i] : A[i * lda + l];
          const double y = dims.trans_b ? B[j * ldb + l] : B[l * ldb + j];
          sum += x * y;
        }
        double& out = C[i * ldc + j];
        out = alpha * sum + (bias ? bias[j] : 0.0) + (accumulate ? out : 0.0);
      }
    }
  }
}

void grouped_matmul(const GroupedMatmulDims& dims, const Vec& a, const Vec& b, Vec& c, double alpha,
                    bool accumulate) {
  const std::span<const double> as(a), bs(b);
  const int64_t ldc = dims.ldc > 0 ? dims.ldc : dims.n;
  int64_t first = 0;
  for (size_t g = 0; g < dims.sizes.size(); ++g) {
    const int64_t rows = dims.sizes[g];
    const auto gi = static_cast<int64_t>(g);
    // The group's C, gathered, computed and put back.
    const int64_t c0 = dims.along_k ? gi * dims.m * dims.n : first * ldc;
    const int64_t c_len = dims.along_k ? dims.m * dims.n : rows * ldc;
    Vec cg(c.begin() + c0, c.begin() + c0 + c_len);
    if (dims.along_k) {
      matmul({.m = dims.m, .n = dims.n, .k = rows, .trans_a = true},
             as.subspan(static_cast<size_t>(first * dims.m)),
             bs.subspan(static_cast<size_t>(first * dims.n)), cg, alpha, accumulate, nullptr);
    } else {
      matmul({.m = rows, .n = dims.n, .k = dims.k, .trans_b = dims.trans_b, .ldc = ldc},
             as.subspan(static_cast<size_t>(first * dims.k)),
             bs.subspan(static_cast<size_t>(gi * dims.k * dims.n)), cg, alpha, accumulate, nullptr);
    }
    std::copy(cg.begin(), cg.end(), c.begin() + c0);
    first += rows;
  }
}

void rmsnorm_forward(const Vec& x, const Vec& w, Vec& y, Vec& rstd, int64_t rows, int64_t dim,
                     double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[static_cast<size_t>(r * dim)];
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    rstd[static_cast<size_t>(r)] = rs;
    for (int64_t i = 0; i < dim; ++i)
      y[static_cast<size_t>(r * dim + i)] = xr[i] * rs * w[static_cast<size_t>(i)];
  }
}

void rmsnorm_backward(const Vec& x, const Vec& w, const Vec& dy, Vec& dx, Vec& dw, int64_t rows,
                      int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const size_t o = static_cast<size_t>(r * dim);
    double ss = 0, dot = 0;
    for (int64_t i = 0; i < dim; ++i) ss += x[o + i] * x[o + i];
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) dot += dy[o + i] * w[static_cast<size_t>(i)] * x[o + i];
    for (int64_t i = 0; i < dim; ++i) {
      dx[o + i] += rs * w[static_cast<size_t>(i)] * dy[o + i] -
                   rs * rs * rs / static_cast<double>(dim) * x[o + i] * dot;
      dw[static_cast<size_t>(i)] += dy[o + i] * x[o + i] * rs;
    }
  }
}

void layernorm_forward(const Vec& x, const Vec& w, const Vec& b, Vec& y, Vec& mean, Vec& rstd,
                       int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const size_t o = static_cast<size_t>(r * dim);
    double mu = 0, var = 0;
    for (int64_t i = 0; i < dim; ++i) mu += x[o + i];
    mu /= static_cast<double>(dim);
    for (int64_t i = 0; i < dim; ++i) var += (x[o + i] - mu) * (x[o + i] - mu);
    const double rs = 1.0 / std::sqrt(var / static_cast<double>(dim) + eps);
    mean[static_cast<size_t>(r)] = mu;
    rstd[static_cast<size_t>(r)] = rs;
    for (int64_t i = 0; i < dim; ++i) {
      y[o + i] = (x[o + i] - mu) * rs * w[static_cast<size_t>(i)] + b[static_cast<size_t>(i)];
    }
  }
}

void layernorm_backward(const Vec& x, const Vec& w, const Vec& dy, Vec& dx, Vec& dw, Vec& db,
                        int64_t rows, int64_t dim, double eps) {
  Vec y(x.size()), mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
  const Vec zero(static_cast<size_t>(dim), 0.0), one(static_cast<size_t>(dim), 1.0);
  layernorm_forward(x, one, zero, y, mean, rstd, rows, dim, eps);  // y = xhat
  for (int64_t r = 0; r < rows; ++r) {
    const size_t o = static_cast<size_t>(r * dim);
    double mg = 0, mgx = 0;
    for (int64_t i = 0; i < dim; ++i) {
      const double g = dy[o + i] * w[static_cast<size_t>(i)];
      mg += g;
      mgx += g * y[o + i];
    }
    mg /= static_cast<double>(dim);
    mgx /= static_cast<double>(dim);
    for (int64_t i = 0; i < dim; ++i) {
      const double g = dy[o + i] * w[static_cast<size_t>(i)];
      dx[o + i] += rstd[static_cast<size_t>(r)] * (g - mg - y[o + i] * mgx);
      dw[static_cast<size_t>(i)] += dy[o + i] * y[o + i];
      db[static_cast<size_t>(i)] += dy[o + i];
    }
  }
}

void swiglu_forward(const Vec& gate_up, Vec& out, int64_t rows, int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < hidden; ++j) {
      const double g = gate_up[static_cast<size_t>(r * 2 * hidden + j)];
      const double u = gate_up[static_cast<size_t>(r * 2 * hidden + hidden + j)];
      out[static_cast<size_t>(r * hidden + j)] = silu(g) * u;
    }
  }
}

void swiglu_backward(const Vec& gate_up, const Vec& d_out, Vec& d_gate_up, int64_t rows,
                     int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < hidden; ++j) {
      const size_t gi = static_cast<size_t>(r * 2 * hidden + j),
                   ui = gi + static_cast<size_t>(hidden);
      const double g = gate_up[gi], u = gate_up[ui], d = d_out[static_cast<size_t>(r * hidden + j)];
      const double s = sigmoid(g);
      d_gate_up[gi] = d * u * s * (1.0 + g * (1.0 - s));
      d_gate_up[ui] = d * silu(g);
    }
  }
}

void gelu_forward(const Vec& x, Vec& y) {
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    y[i] = 0.5 * v * (1.0 + std::tanh(kGeluC0 * (v + kGeluC1 * v * v * v)));
  }
}

void gelu_backward(const Vec& x, const Vec& dy, Vec& dx) {
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i], t = std::tanh(kGeluC0 * (v + kGeluC1 * v * v * v));
    const double grad =
        0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * kGeluC0 * (1.0 + 3.0 * kGeluC1 * v * v);
    dx[i] = dy[i] * grad;
  }
}

void attention_forward(const AttentionDims& dims, std::span<const float> inv_freq, const Vec& qkv,
                       Vec& out, int64_t pos0) {
  const AttentionRows a(dims, inv_freq, qkv, pos0);
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t t = 0; t < a.T; ++t) {
      for (int64_t h = 0; h < a.H; ++h) {
        const Vec p = a.probs(b, t, h);
        const int64_t s0 = a.first[static_cast<size_t>(b * a.T + t)], kvh = h / (a.H / a.KV);
        double* o = &out[static_cast<size_t>(((b * a.T + t) * a.H + h) * a.D)];
        std::fill(o, o + a.D, 0.0);
        for (int64_t s = s0; s <= t; ++s) {
          for (int64_t i = 0; i < a.D; ++i)
            o[i] += p[static_cast<size_t>(s - s0)] * a.vr(b, s, kvh)[i];
        }
      }
    }
  }
}

void attention_backward(const AttentionDims& dims, std::span<const float> inv_freq, const Vec& qkv,
                        const Vec& d_out, Vec& d_qkv) {
  const AttentionRows a(dims, inv_freq, qkv, 0);
  Vec dq(a.q.size(), 0.0), dk(a.k.size(), 0.0), dv(a.v.size(), 0.0);
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t t = 0; t < a.T; ++t) {
      for (int64_t h = 0; h < a.H; ++h) {
        const Vec p = a.probs(b, t, h);
        const int64_t s0 = a.first[static_cast<size_t>(b * a.T + t)], kvh = h / (a.H / a.KV);
        const double* dO = &d_out[static_cast<size_t>(((b * a.T + t) * a.H + h) * a.D)];
        Vec dp(p.size());
        double pdp = 0;
        for (int64_t s = s0; s <= t; ++s) {
          double dot = 0;
          for (int64_t i = 0; i < a.D; ++i) dot += dO[i] * a.vr(b, s, kvh)[i];
          dp[static_cast<size_t>(s - s0)] = dot;
          pdp += p[static_cast<size_t>(s - s0)] * dot;
        }
        for (int64_t s = s0; s <= t; ++s) {
          const double ps = p[static_cast<size_t>(s - s0)];
          const double ds = ps * (dp[static_cast<size_t>(s - s0)] - pdp) * a.scale;
          double* dqr = &dq[static_cast<size_t>(((b * a.T + t) * a.H + h) * a.D)];
          double* dkr = &dk[static_cast<size_t>(((b * a.T + s) * a.KV + kvh) * a.D)];
          double* dvr = &dv[static_cast<size_t>(((b * a.T + s) * a.KV + kvh) * a.D)];
          for (int64_t i = 0; i < a.D; ++i) {
            dqr[i] += ds * a.kr(b, s, kvh)[i];
            dkr[i] += ds * a.qr(b, t, h)[i];
            dvr[i] += ps * dO[i];
          }
        }
      }
    }
  }
  // Back through the rotation (its transpose) into the qkv layout.
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t pos = dims.positions ? dims.positions[b * a.T + t] : t;
      double* row = &d_qkv[static_cast<size_t>((b * a.T + t) * a.W)];
      for (int64_t h = 0; h < a.H; ++h) {
        std::copy_n(&dq[static_cast<size_t>(((b * a.T + t) * a.H + h) * a.D)], a.D, row + h * a.D);
        rotate(row + h * a.D, a.D, pos, inv_freq, true);
      }
      for (int64_t h = 0; h < a.KV; ++h) {
        std::copy_n(&dk[static_cast<size_t>(((b * a.T + t) * a.KV + h) * a.D)], a.D,
                    row + (a.H + h) * a.D);
        rotate(row + (a.H + h) * a.D, a.D, pos, inv_freq, true);
        std::copy_n(&dv[static_cast<size_t>(((b * a.T + t) * a.KV + h) * a.D)], a.D,
                    row + (a.H + a.KV + h) * a.D);
      }
    }
  }
}

void embedding_forward(const EmbeddingDims& dims, const Vec& table, const Vec* positions,
                       std::span<const int32_t> ids, Vec& out) {
  const int64_t dim = dims.dim;
  for (int64_t r = 0; r < dims.batch * dims.seq; ++r) {
    const int64_t id = ids[static_cast<size_t>(r)], p = dims.position(r);
    for (int64_t i = 0; i < dim; ++i) {
      const double row =
          dims.holds(id) ? table[static_cast<size_t>((id - dims.vocab_begin) * dim + i)] : 0.0;
      out[static_cast<size_t>(r * dim + i)] =
          row + (positions ? (*positions)[static_cast<size_t>(p * dim + i)] : 0.0);
    }
  }
}

void embedding_backward(const EmbeddingDims& dims, std::span<const int32_t> ids, const Vec& dout,
                        Vec& dtable, Vec* dpositions) {
  const int64_t dim = dims.dim;
  for (int64_t r = 0; r < dims.batch * dims.seq; ++r) {
    const int64_t id = ids[static_cast<size_t>(r)], p = dims.position(r);
    for (int64_t i = 0; i < dim; ++i) {
      const double g = dout[static_cast<size_t>(r * dim + i)];
      if (dims.holds(id)) dtable[static_cast<size_t>((id - dims.vocab_begin) * dim + i)] += g;
      if (dpositions) (*dpositions)[static_cast<size_t>(p * dim + i)] += g;
    }
  }
}

double fused_classifier(const Vec& h, const Vec& w, std::span<const int32_t> targets, int64_t rows,
                        int64_t dim, int64_t vocab, int64_t valid, double grad_scale, Vec* dh,
                        Vec* dw, Vec* row_losses, std::span<const float> row_weights) {
  double total = 0;
  Vec logits(static_cast<size_t>(vocab));
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t target = targets[static_cast<size_t>(r)];
    double mx = -1e300, sum = 0;
    for (int64_t v = 0; v < valid; ++v) {
      double z = 0;
      for (int64_t i = 0; i < dim; ++i)
        z += h[static_cast<size_t>(r * dim + i)] * w[static_cast<size_t>(v * dim + i)];
      logits[static_cast<size_t>(v)] = z;
      mx = std::max(mx, z);
    }
    for (int64_t v = 0; v < valid; ++v) sum += std::exp(logits[static_cast<size_t>(v)] - mx);
    const double lse = mx + std::log(sum);
    const double loss = target < 0 ? 0.0 : lse - logits[static_cast<size_t>(target)];
    if (row_losses) (*row_losses)[static_cast<size_t>(r)] = loss;
    total += loss;
    if (dh) std::fill_n(dh->begin() + r * dim, dim, 0.0);
    if (target < 0) continue;
    const double scale =
        grad_scale * (row_weights.empty() ? 1.0 : row_weights[static_cast<size_t>(r)]);
    for (int64_t v = 0; v < valid; ++v) {
      const double g =
          scale * (std::exp(logits[static_cast<size_t>(v)] - lse) - (v == target ? 1.0 : 0.0));
      for (int64_t i = 0; i < dim; ++i) {
        if (dh) (*dh)[static_cast<size_t>(r * dim + i)] += g * w[static_cast<size_t>(v * dim + i)];
        if (dw) (*dw)[static_cast<size_t>(v * dim + i)] += g * h[static_cast<size_t>(r * dim + i)];
      }
    }
  }
  return total;
}

void adamw_update(const AdamWHyper& hyper, Vec& param, Vec& grad, Vec& m, Vec& v) {
  const double b1 = hyper.beta1, b2 = hyper.beta2, t = static_cast<double>(hyper.step);
  const double bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
  for (size_t i = 0; i < param.size(); ++i) {
    const double g = grad[i] * hyper.grad_scale;
    m[i] = b1 * m[i] + (1.0 - b1) * g;
    v[i] = b2 * v[i] + (1.0 - b2) * g * g;
    param[i] = param[i] * (1.0 - static_cast<double>(hyper.lr) * hyper.weight_decay) -
               hyper.lr / bc1 * m[i] / (std::sqrt(v[i] / bc2) + hyper.eps);
    if (hyper.clear_grad) grad[i] = 0.0;
  }
}

// Each token's log-sum-exp of its logits, and their softmax.
Vec log_sum_exp(const RouterDims& dims, const Vec& logits) {
  Vec lse(static_cast<size_t>(dims.tokens));
  for (int64_t t = 0; t < dims.tokens; ++t) {
    const double* l = logits.data() + t * dims.experts;
    const double mx = *std::max_element(l, l + dims.experts);
    double sum = 0;
    for (int64_t e = 0; e < dims.experts; ++e) sum += std::exp(l[e] - mx);
    lse[t] = mx + std::log(sum);
  }
  return lse;
}

void router_forward(const RouterDims& dims, const Vec& logits, Vec& probs,
                    std::vector<int32_t>& indices, Vec& weights, Vec& lse) {
  const int64_t E = dims.experts, K = dims.top_k, G = dims.n_groups, per = E / G;
  lse = log_sum_exp(dims, logits);
  probs.assign(logits.size(), 0.0);
  indices.assign(static_cast<size_t>(dims.tokens * K), 0);
  weights.assign(static_cast<size_t>(dims.tokens * K), 0.0);
  for (int64_t t = 0; t < dims.tokens; ++t) {
    const double* l = logits.data() + t * E;
    double* p = probs.data() + t * E;
    if (dims.score == RouterScore::softmax) {
      for (int64_t e = 0; e < E; ++e) p[e] = std::exp(l[e] - lse[t]);
    } else {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.0 / (1.0 + std::exp(-l[e]));
    }
    // Selection scores; a group's score is the sum of its two best (sorted).
    std::vector<double> s(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) s[e] = p[e] + (dims.bias ? dims.bias[e] : 0.0);
    std::vector<std::pair<double, int64_t>> group_rank;
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> members(s.begin() + g * per, s.begin() + (g + 1) * per);
      std::sort(members.rbegin(), members.rend());
      group_rank.emplace_back(-(per == 1 ? members[0] : members[0] + members[1]), g);
    }
    std::sort(group_rank.begin(), group_rank.end());
    std::vector<bool> eligible(static_cast<size_t>(E), G == 1);
    for (int64_t i = 0; G > 1 && i < dims.topk_groups; ++i) {
      for (int64_t e = 0; e < per; ++e) eligible[group_rank[i].second * per + e] = true;
    }
    std::vector<std::pair<double, int64_t>> rank;  // (-score, expert): ascending = best first
    for (int64_t e = 0; e < E; ++e) {
      if (eligible[e]) rank.emplace_back(-s[e], e);
    }
    std::sort(rank.begin(), rank.end());
    double total = 0;
    for (int64_t j = 0; j < K; ++j) total += p[rank[j].second];
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = rank[j].second;
      indices[t * K + j] = static_cast<int32_t>(e);
      weights[t * K + j] = dims.scaling * (dims.renormalize ? p[e] / total : p[e]);
    }
  }
}

void router_backward(const RouterDims& dims, const Vec& probs, std::span<const int32_t> indices,
                     const Vec& d_weights, const Vec& score_grad, const Vec& logits, double z,
                     Vec& d_logits) {
  const int64_t E = dims.experts, K = dims.top_k;
  d_logits.assign(probs.size(), 0.0);
  const Vec lse = log_sum_exp(dims, logits);
  for (int64_t t = 0; t < dims.tokens; ++t) {
    const double* p = probs.data() + t * E;
    // d(weight_j)/d(p_e) summed over j: the weights as functions of the chosen p.
    Vec dp = score_grad.empty() ? Vec(static_cast<size_t>(E), 0.0) : score_grad;
    double total = 0;
    for (int64_t j = 0; j < K; ++j) total += p[indices[t * K + j]];
    for (int64_t j = 0; j < K; ++j) {
      const int64_t ej = indices[t * K + j];
      const double g = d_weights[t * K + j] * dims.scaling;
      if (!dims.renormalize) {
        dp[ej] += g;
        continue;
      }
      for (int64_t i = 0; i < K; ++i) {
        const int64_t ei = indices[t * K + i];
        dp[ei] += g * ((ei == ej ? 1.0 : 0.0) / total - p[ej] / (total * total));
      }
    }
    double* dl = d_logits.data() + t * E;
    for (int64_t e = 0; e < E; ++e) {
      if (dims.score == RouterScore::sigmoid) {
        dl[e] = dp[e] * p[e] * (1.0 - p[e]);
        continue;
      }
      for (int64_t f = 0; f < E; ++f) dl[e] += dp[f] * p[f] * ((e == f ? 1.0 : 0.0) - p[e]);
    }
    // The z-loss: z * lse * softmax(logits).
    for (int64_t e = 0; e < E; ++e) dl[e] += z * lse[t] * std::exp(logits[t * E + e] - lse[t]);
  }
}

Dispatch moe_sort(const DispatchDims& dims, std::span<const int32_t> indices) {
  Dispatch d;
  const int64_t n = dims.slots();
  d.slots.resize(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) d.slots[s] = static_cast<int32_t>(s);
  std::stable_sort(d.slots.begin(), d.slots.end(),
                   [&](int32_t a, int32_t b) { return indices[a] < indices[b]; });
  d.rows.resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) d.rows[d.slots[r]] = static_cast<int32_t>(r);
  d.counts.assign(static_cast<size_t>(dims.experts), 0);
  for (int64_t s = 0; s < n; ++s) ++d.counts[indices[s]];
  return d;
}

void moe_capacity(const DispatchDims& dims, int64_t capacity, const Vec& weights, Dispatch& order) {
  // Per expert: its slots ranked by (weight descending, slot ascending); the first `capacity` stay.
  std::vector<int32_t> kept_slots, dropped;
  order.kept.assign(order.counts.size(), 0);
  auto first = order.slots.begin();
  for (int64_t e = 0; e < dims.experts; ++e) {
    std::vector<int32_t> ranked(first, first + order.counts[e]);
    first += order.counts[e];
    std::sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {
      return weights[a] != weights[b] ? weights[a] > weights[b] : a < b;
    });
    const auto keep = static_cast<size_t>(std::min<int64_t>(capacity, std::ssize(ranked)));
    std::sort(ranked.begin(), ranked.begin() + static_cast<int64_t>(keep));
    kept_slots.insert(kept_slots.end(), ranked.begin(), ranked.begin() + static_cast<int64_t>(keep));
    dropped.insert(dropped.end(), ranked.begin() + static_cast<int64_t>(keep), ranked.end());
    order.kept[e] = static_cast<int32_t>(keep);
  }
  std::sort(dropped.begin(), dropped.end());
  order.slots = kept_slots;
  order.slots.insert(order.slots.end(), dropped.begin(), dropped.end());
  for (size_t r = 0; r < kept_slots.size(); ++r) order.rows[kept_slots[r]] = static_cast<int32_t>(r);
  for (int32_t s : dropped) order.rows[s] = -1;
}

void moe_permute(const DispatchDims& dims, const Dispatch& order, const Vec& x, Vec& out) {
  out.assign(static_cast<size_t>(dims.slots() * dims.dim), 0.0);
  for (int64_t r = 0; r < dims.slots(); ++r) {
    const int64_t t = order.slots[r] / dims.top_k;
    for (int64_t i = 0; i < dims.dim; ++i) out[r * dims.dim + i] = x[t * dims.dim + i];
  }
}

void moe_permute_backward(const DispatchDims& dims, const Dispatch& order, const Vec& d_out,
                          Vec& dx) {
  dx.assign(static_cast<size_t>(dims.tokens * dims.dim), 0.0);
  for (int64_t r = 0; r < dims.slots(); ++r) {
    if (order.rows[order.slots[r]] != r) continue;  // dropped
    const int64_t t = order.slots[r] / dims.top_k;
    for (int64_t i = 0; i < dims.dim; ++i) dx[t * dims.dim + i] += d_out[r * dims.dim + i];
  }
}

void dequantize_nf4(std::span<const uint8_t> packed, int64_t n, Vec& out, nf4::Form form) {
  // The absmax in float64 from its stored parts (a slice stores it in f32).
  const nf4::Layout l = nf4::layout(n, form);
  float offset = 0;
  if (form == nf4::Form::whole) std::memcpy(&offset, packed.data() + l.offset_at, 4);
  out.assign(static_cast<size_t>(n), 0.0);
  for (int64_t b = 0; b < l.blocks; ++b) {
    float stored = 0;
    double absmax = 0;
    if (form == nf4::Form::slice) {
      std::memcpy(&stored, packed.data() + l.absmax_at + 4 * b, 4);
      absmax = stored;
    } else {
      std::memcpy(&stored, packed.data() + l.scales_at + 4 * (b / nf4::kScaleBlock), 4);
      absmax = static_cast<double>(nf4::dynamic_map()[packed[static_cast<size_t>(l.codes_at + b)]]) *
                   stored +
               offset;
    }
    for (int64_t i = b * nf4::kBlock; i < (b + 1) * nf4::kBlock; ++i) {
      const uint8_t pair = packed[static_cast<size_t>(l.packed_at + i / 2)];
      const int q = i % 2 == 0 ? pair >> 4 : pair & 0xF;
      out[static_cast<size_t>(i)] = static_cast<double>(nf4::levels()[q]) * absmax;
    }
  }
}

void moe_combine(const DispatchDims& dims, const Dispatch& order, const Vec& weights, const Vec& y,
                 Vec& out) {
  out.assign(static_cast<size_t>(dims.tokens * dims.dim), 0.0);
  for (int64_t r = 0; r < dims.slots(); ++r) {
    const int64_t s = order.slots[r], t = s / dims.top_k;
    if (order.rows[s] != r) continue;  // dropped
    for (int64_t i = 0; i < dims.dim; ++i) out[t * dims.dim + i] += weights[s] * y[r * dims.dim + i];
  }
}

void moe_combine_backward(const DispatchDims& dims, const Dispatch& order, const Vec& weights,
                          const Vec& y, const Vec& d_out, Vec& d_y, Vec& d_weights) {
  d_y.assign(static_cast<size_t>(dims.slots() * dims.dim), 0.0);
  d_weights.assign(static_cast<size_t>(dims.slots()), 0.0);
  for (int64_t r = 0; r < dims.slots(); ++r) {
    const int64_t s = order.slots[r], t = s / dims.top_k;
    if (order.rows[s] != r) continue;  // dropped: d_y's row untouched, no d_weight
    for (int64_t i = 0; i < dims.dim; ++i) {
      d_y[r * dims.dim + i] = weights[s] * d_out[t * dims.dim + i];
      d_weights[s] += d_out[t * dims.dim + i] * y[r * dims.dim + i];
    }
  }
}

}  // namespace meshtrain::ops::reference
