#include "meshtrain/backend/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain::cpu {

void check_router(const ops::RouterDims& d) {
  MESHTRAIN_CHECK(d.tokens >= 0 && d.experts >= 1, "router: tokens {} and experts {} out of range",
                  d.tokens, d.experts);
  MESHTRAIN_CHECK(d.top_k >= 1 && d.top_k <= d.experts,
                  "router: top_k = {} must be in [1, experts = {}]", d.top_k, d.experts);
  MESHTRAIN_CHECK(d.n_groups >= 1 && d.experts % d.n_groups == 0,
                  "router: n_groups = {} must divide experts = {}", d.n_groups, d.experts);
  MESHTRAIN_CHECK(d.topk_groups >= 1 && d.topk_groups <= d.n_groups &&
                      d.top_k <= d.topk_groups * (d.experts / d.n_groups),
                  "router: topk_groups = {} of n_groups = {} must hold top_k = {} experts",
                  d.topk_groups, d.n_groups, d.top_k);
}

namespace {

// The k best of `order`'s candidates by score, ties to the lower index.
void best(std::vector<int32_t>& order, int64_t k, const float* score) {
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [score](int32_t a, int32_t b) {
    return score[a] != score[b] ? score[a] > score[b] : a < b;
  });
  order.resize(static_cast<size_t>(k));
}

}  // namespace

void router_forward(const ops::RouterDims& d, const float* logits, float* probs, int32_t* indices,
                    float* weights, float* lse) {
  check_router(d);
  const int64_t E = d.experts, K = d.top_k, G = d.n_groups, per_group = E / G;
#pragma omp parallel
  {
    std::vector<float> sel(static_cast<size_t>(E)), group_score(static_cast<size_t>(G));
    std::vector<int32_t> order, groups;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.tokens; ++t) {
      const float* l = logits + t * E;
      float* p = probs + t * E;
      const float mx = *std::max_element(l, l + E);
      if (d.score == ops::RouterScore::softmax) {
        float sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(l[e] - mx);
        for (int64_t e = 0; e < E; ++e) p[e] /= sum;
        if (lse != nullptr) lse[t] = mx + std::log(sum);
      } else {
        for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
        if (lse != nullptr) {
          float sum = 0;
          for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - mx);
          lse[t] = mx + std::log(sum);
        }
      }
      for (int64_t e = 0; e < E; ++e) sel[e] = p[e] + (d.bias ? d.bias[e] : 0.0f);
      order.clear();
      if (G == 1) {
        order.resize(static_cast<size_t>(E));
        std::iota(order.begin(), order.end(), 0);
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float* s = sel.data() + g * per_group;
          const float top = *std::max_element(s, s + per_group);
          float second = -INFINITY;
          bool skipped = false;  // the best once, then the next best (ties included)
          for (int64_t e = 0; e < per_group; ++e) {
            if (s[e] == top && !skipped) {
              skipped = true;
              continue;
            }
            second = std::max(second, s[e]);
          }
          group_score[g] = per_group == 1 ? top : top + second;
        }
        groups.resize(static_cast<size_t>(G));
        std::iota(groups.begin(), groups.end(), 0);
        best(groups, d.topk_groups, group_score.data());
        std::sort(groups.begin(), groups.end());
        for (int32_t g : groups) {
          for (int64_t e = 0; e < per_group; ++e) order.push_back(static_cast<int32_t>(g * per_group + e));
        }
      }
      best(order, K, sel.data());
      float total = 0;
      for (int64_t j = 0; j < K; ++j) total += p[order[j]];
      const float norm = d.renormalize ? d.scaling / total : d.scaling;
      for (int64_t j = 0; j < K; ++j) {
        indices[t * K + j] = order[j];
        weights[t * K + j] = p[order[j]] * norm;
      }
    }
  }
}

void router_backward(const ops::RouterDims& d, const float* probs, const int32_t* indices,
                     const float* d_weights, const ops::RouterAuxGrad& aux, float* d_logits) {
  check_router(d);
  const int64_t E = d.experts, K = d.top_k;
#pragma omp parallel
  {
    std::vector<float> dp(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.tokens; ++t) {
      const float* p = probs + t * E;
      const int32_t* idx = indices + t * K;
      const float* dw = d_weights + t * K;
      if (aux.score_grad != nullptr) {
        std::copy(aux.score_grad, aux.score_grad + E, dp.begin());
      } else {
        std::fill(dp.begin(), dp.end(), 0.0f);
      }
      // w_j = scaling * p_j (/ S, S = sum of the k chosen p when renormalising).
      float total = 0, dot = 0;
      for (int64_t j = 0; j < K; ++j) {
        total += p[idx[j]];
        dot += dw[j] * p[idx[j]];
      }
      for (int64_t j = 0; j < K; ++j) {
        dp[idx[j]] += d.renormalize ? d.scaling * (dw[j] / total - dot / (total * total))
                                    : d.scaling * dw[j];
      }
      float* dl = d_logits + t * E;
      if (d.score == ops::RouterScore::softmax) {
        float inner = 0;
        for (int64_t e = 0; e < E; ++e) inner += dp[e] * p[e];
        for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dp[e] - inner);
      } else {
        for (int64_t e = 0; e < E; ++e) dl[e] = dp[e] * p[e] * (1.0f - p[e]);
      }
      if (aux.z == 0) continue;
      // The z-loss: softmax(logits) is p itself, or from the sigmoid's logits
      // log(p / (1 - p)), p kept below 1 (a saturated sigmoid's logit is lost).
      const float zl = aux.z * aux.lse[t];
      for (int64_t e = 0; e < E; ++e) {
        const float q = std::min(p[e], 1.0f - 0x1p-24f);
        const float soft = d.score == ops::RouterScore::softmax
                               ? p[e]
                               : std::exp(std::log(q) - std::log1p(-q) - aux.lse[t]);
        dl[e] += zl * soft;
      }
    }
  }
}

}  // namespace meshtrain::cpu
