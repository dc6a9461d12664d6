// One token's mixture-of-experts routing and its backward (ops::RouterDims,
// backend.h's router_forward / router_backward): the functions the CPU
// backend runs per token and the CUDA backend per thread, so both choose the
// same experts by the same rule and `meshtrain ops test` on the CPU checks
// the code a GPU runs. No allocation: the caller gives the scratch.
#pragma once

#include <cmath>
#include <cstdint>

#include "meshtrain/backend/host_device.h"

namespace meshtrain::routing {

// ops::RouterDims without the host-side checks (ops::check_router).
struct Params {
  int64_t experts = 0, top_k = 1, n_groups = 1, topk_groups = 1;
  bool softmax = true, renormalize = false;
  float scaling = 1.0f;
  const float* bias = nullptr;  // [experts] or nullptr
};

// The best of the candidates (candidate[e] != 0) by score, ties to the lower
// index; -1 when none is left.
MESHTRAIN_HD int64_t best_candidate(const float* score, const uint8_t* candidate, int64_t n) {
  int64_t best = -1;
  for (int64_t e = 0; e < n; ++e) {
    if (candidate[e] != 0 && (best < 0 || score[e] > score[best])) best = e;
  }
  return best;
}

// logits [E] -> p [E] (softmax or sigmoid scores), idx / w [top_k], *lse (the
// log-sum-exp of the logits) when lse is not null. Scratch: sel [E] floats,
// group_score [n_groups] floats, candidate [E] and group_candidate [n_groups] bytes.
MESHTRAIN_HD void route_token(const Params& d, const float* l, float* p, int32_t* idx, float* w,
                              float* lse, float* sel, float* group_score, uint8_t* candidate,
                              uint8_t* group_candidate) {
  const int64_t E = d.experts, K = d.top_k, G = d.n_groups, per_group = E / G;
  float mx = l[0];
  for (int64_t e = 1; e < E; ++e) mx = l[e] > mx ? l[e] : mx;
  if (d.softmax) {
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += p[e] = expf(l[e] - mx);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    if (lse != nullptr) *lse = mx + logf(sum);
  } else {
    for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + expf(-l[e]));
    if (lse != nullptr) {
      float sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += expf(l[e] - mx);
      *lse = mx + logf(sum);
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    sel[e] = p[e] + (d.bias != nullptr ? d.bias[e] : 0.0f);
    candidate[e] = 1;
  }
  if (G > 1) {
    // A group scores its best plus its next best (the best counted once).
    for (int64_t g = 0; g < G; ++g) {
      const float* s = sel + g * per_group;
      float top = s[0];
      for (int64_t e = 1; e < per_group; ++e) top = s[e] > top ? s[e] : top;
      float second = -INFINITY;
      bool skipped = false;
      for (int64_t e = 0; e < per_group; ++e) {
        if (s[e] == top && !skipped) {
          skipped = true;
          continue;
        }
        second = s[e] > second ? s[e] : second;
      }
      group_score[g] = per_group == 1 ? top : top + second;
      group_candidate[g] = 1;
    }
    // The topk_groups best groups (ties to the lower group) hold the candidates.
    for (int64_t e = 0; e < E; ++e) candidate[e] = 0;
    for (int64_t j = 0; j < d.topk_groups; ++j) {
      const int64_t g = best_candidate(group_score, group_candidate, G);
      group_candidate[g] = 0;
      for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) candidate[e] = 1;
    }
  }
  float total = 0;
  for (int64_t j = 0; j < K; ++j) {
    const int64_t e = best_candidate(sel, candidate, E);
    candidate[e] = 0;
    idx[j] = static_cast<int32_t>(e);
    total += p[e];
  }
  const float norm = d.renormalize ? d.scaling / total : d.scaling;
  for (int64_t j = 0; j < K; ++j) w[j] = p[idx[j]] * norm;
}

// d logits [E] (overwritten) of one token from d w [top_k], through the
// weights' normalisation and the score function; score_grad [E] (the
// load-balancing loss's slopes, or null) added to d p first; z (the z-loss's
// scale, 0: none) with the token's lse. Scratch: dp [E].
MESHTRAIN_HD void route_token_backward(const Params& d, const float* p, const int32_t* idx,
                                       const float* dw, const float* score_grad, float z,
                                       float lse, float* dp, float* dl) {
  const int64_t E = d.experts, K = d.top_k;
  for (int64_t e = 0; e < E; ++e) dp[e] = score_grad != nullptr ? score_grad[e] : 0.0f;
  // w_j = scaling * p_j (/ S, S = the sum of the k chosen p when renormalising).
  float total = 0, dot = 0;
  for (int64_t j = 0; j < K; ++j) {
    total += p[idx[j]];
    dot += dw[j] * p[idx[j]];
  }
  for (int64_t j = 0; j < K; ++j) {
    dp[idx[j]] += d.renormalize ? d.scaling * (dw[j] / total - dot / (total * total))
                                : d.scaling * dw[j];
  }
  if (d.softmax) {
    float inner = 0;
    for (int64_t e = 0; e < E; ++e) inner += dp[e] * p[e];
    for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dp[e] - inner);
  } else {
    for (int64_t e = 0; e < E; ++e) dl[e] = dp[e] * p[e] * (1.0f - p[e]);
  }
  if (z == 0) return;
  // The z-loss: softmax(logits) is p itself, or from the sigmoid's logits
  // log(p / (1 - p)), p kept below 1 (a saturated sigmoid's logit is lost).
  const float zl = z * lse;
  for (int64_t e = 0; e < E; ++e) {
    const float q = p[e] < 1.0f - 0x1p-24f ? p[e] : 1.0f - 0x1p-24f;
    const float soft = d.softmax ? p[e] : expf(logf(q) - log1pf(-q) - lse);
    dl[e] += zl * soft;
  }
}

}  // namespace meshtrain::routing
