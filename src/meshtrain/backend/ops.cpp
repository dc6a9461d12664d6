#include "meshtrain/backend/ops.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "meshtrain/util/context_split.h"
#include "meshtrain/util/error.h"

namespace meshtrain::ops {

std::vector<float> rope_inv_freq(int64_t head_dim, float theta) {
  MESHTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim {} must be even", head_dim);
  std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  }
  return inv_freq;
}

void rope_table_values(int64_t head_dim, int64_t max_seq, std::span<const float> inv_freq,
                       float* cos, float* sin) {
  MESHTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim {} must be even", head_dim);
  MESHTRAIN_CHECK(max_seq > 0, "rope: max_seq {} must be positive", max_seq);
  const int64_t half = head_dim / 2;
  MESHTRAIN_CHECK(static_cast<int64_t>(inv_freq.size()) == half,
                  "rope: {} frequencies for head_dim {}", inv_freq.size(), head_dim);
  for (int64_t i = 0; i < half; ++i) {
    const float freq = inv_freq[static_cast<size_t>(i)];
    for (int64_t p = 0; p < max_seq; ++p) {
      const float angle = static_cast<float>(p) * freq;
      cos[p * half + i] = std::cos(angle);
      sin[p * half + i] = std::sin(angle);
    }
  }
}

void check_router(const RouterDims& d) {
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

// A counting sort of the slots by expert: stable, so slot order within one.
void sort_slots(const DispatchDims& d, const int32_t* indices, int32_t* slots, int32_t* rows,
              int32_t* counts) {
  const int64_t n = d.slots();
  std::fill(counts, counts + d.experts, 0);
  for (int64_t s = 0; s < n; ++s) {
    MESHTRAIN_CHECK(indices[s] >= 0 && indices[s] < d.experts,
                    "moe dispatch: token {} chose expert {}, outside [0, {})", s / d.top_k,
                    indices[s], d.experts);
    ++counts[indices[s]];
  }
  std::vector<int64_t> next(static_cast<size_t>(d.experts), 0);
  for (int64_t e = 1; e < d.experts; ++e) next[e] = next[e - 1] + counts[e - 1];
  for (int64_t s = 0; s < n; ++s) {
    const int64_t r = next[indices[s]]++;
    slots[r] = static_cast<int32_t>(s);
    rows[s] = static_cast<int32_t>(r);
  }
}

void apply_capacity(const DispatchDims& d, int64_t capacity, const float* weights,
                  const int32_t* counts, int32_t* slots, int32_t* rows, int32_t* kept) {
  MESHTRAIN_CHECK(capacity >= 0, "moe dispatch: capacity {} must be >= 0", capacity);
  const int64_t n = d.slots();
  std::vector<int32_t> order(slots, slots + n), dropped, segment;
  int64_t first = 0, out = 0;
  for (int64_t e = 0; e < d.experts; ++e) {
    const int64_t c = counts[e];
    segment.assign(order.begin() + first, order.begin() + first + c);
    if (c > capacity) {
      // The `capacity` highest weights (ties: the lower slot), back in slot order.
      std::stable_sort(segment.begin(), segment.end(),
                       [weights](int32_t a, int32_t b) { return weights[a] > weights[b]; });
      dropped.insert(dropped.end(), segment.begin() + capacity, segment.end());
      segment.resize(static_cast<size_t>(capacity));
      std::sort(segment.begin(), segment.end());
    }
    kept[e] = static_cast<int32_t>(segment.size());
    for (int32_t s : segment) {
      slots[out] = s;
      rows[s] = static_cast<int32_t>(out++);
    }
    first += c;
  }
  std::sort(dropped.begin(), dropped.end());
  for (int32_t s : dropped) {
    slots[out++] = s;
    rows[s] = -1;
  }
}

namespace {

// The plan's buffers: `a` -> `b` forward, `b` -> `a` back (a is const in the
// Backend signature, which writes it only going back).
CopyPlan plan_between(const void* a, void* b, bool forward) {
  CopyPlan plan;
  plan.src = forward ? a : b;
  plan.dst = forward ? b : const_cast<void*>(a);
  return plan;
}

}  // namespace

CopyPlan head_group_copies(const HeadGroups& g, DType dtype, const void* rows, void* groups,
                           bool to_groups) {
  const int64_t width = g.width(), slice = width / g.groups;
  const auto e = static_cast<int64_t>(dtype_size(dtype));
  CopyPlan plan = plan_between(rows, groups, to_groups);
  for (int64_t p : g.parts) {
    MESHTRAIN_CHECK(g.groups >= 1 && p % g.groups == 0,
                    "head_groups: a part of width {} does not split into {} groups", p, g.groups);
  }
  for (int64_t k = 0; k < g.groups; ++k) {
    int64_t at = 0, offset = 0;  // within the group's slice; the part's start in the row
    for (int64_t p : g.parts) {
      const int64_t w = p / g.groups;
      Copy2D c{(offset + k * w) * e, (k * g.rows * slice + at) * e, w * e, g.rows, width * e,
               slice * e};
      if (!to_groups) {
        std::swap(c.src_offset, c.dst_offset);
        std::swap(c.src_pitch, c.dst_pitch);
      }
      plan.copies.push_back(c);
      at += w;
      offset += p;
    }
  }
  return plan;
}

void check_context_dims(const ContextDims& d, const RopeTable* rope) {
  MESHTRAIN_CHECK(d.batch > 0 && d.local_seq > 0 && d.n_heads > 0 && d.n_kv_heads > 0 &&
                      d.head_dim > 0 && d.n_heads % d.n_kv_heads == 0,
                  "context attention: bad dims batch={} local_seq={} heads={} kv_heads={} "
                  "head_dim={}",
                  d.batch, d.local_seq, d.n_heads, d.n_kv_heads, d.head_dim);
  MESHTRAIN_CHECK(d.split.size >= 1 && d.split.rank >= 0 && d.split.rank < d.split.size &&
                      d.local_seq % 2 == 0,
                  "context attention: rank {} of {} with {} local tokens (two chunks each)",
                  d.split.rank, d.split.size, d.local_seq);
  MESHTRAIN_CHECK(d.positions != nullptr, "context attention: positions are required");
  MESHTRAIN_CHECK(rope == nullptr || rope->head_dim == d.head_dim,
                  "context attention: rope table head_dim {} != head_dim {}",
                  rope ? rope->head_dim : 0, d.head_dim);
}

CopyPlan context_sequence_copies(const ContextDims& dims, int64_t width, DType dtype,
                                 const void* by_rank, void* sequence, bool to_sequence) {
  const int64_t B = dims.batch, L = dims.local_seq, T = dims.seq(), n = dims.split.size;
  const int64_t row = width * static_cast<int64_t>(dtype_size(dtype));
  CopyPlan plan = plan_between(by_rank, sequence, to_sequence);
  for (int64_t r = 0; r < n; ++r) {
    const ContextSplit split{r, n};
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < L;) {
        int64_t run = 1;  // local tokens i, i + 1, ... at consecutive global positions
        while (i + run < L && split.global(T, i + run) == split.global(T, i) + run) ++run;
        Copy2D c{((r * B + b) * L + i) * row, (b * T + split.global(T, i)) * row, run * row, 1,
                 run * row, run * row};
        if (!to_sequence) std::swap(c.src_offset, c.dst_offset);
        plan.copies.push_back(c);
        i += run;
      }
    }
  }
  return plan;
}

}  // namespace meshtrain::ops
