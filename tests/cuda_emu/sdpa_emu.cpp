// backend/cuda/sdpa/sdpa.h on the emulated device: cuDNN cannot run here, so
// the runner computes what its graphs promise on the host (the emulated
// device's memory is the host's) — softmax attention and its flash-style
// backward from the output and the log-sum-exp, in double, with P and dS
// rounded to the dtype before their products (as tensor-core GEMMs take
// them) and the outputs at the end. What it checks is the backend's side of the cuDNN path:
// the saved output and statistics, the conversions around the graphs, the
// merge back into the qkv rows, recomputation's swaps and the memory plan's
// count. It does not check cuDNN. Its backward workspace is the size the
// memory plan estimates for cuDNN's (sdpa.h), which it does not use.
#include "sdpa_emu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "meshtrain/util/error.h"

#define cuda cuda_emu
#include "meshtrain/backend/cuda/sdpa/sdpa.h"

namespace meshtrain {

bool emu::fused_attention = true;

namespace cuda_emu {
namespace {

constexpr const char* kOff = "the emulated device's fused attention is switched off";

// x rounded to the dtype, as a tensor-core GEMM takes P and dS.
double rounded(DType d, double x) {
  const auto f = static_cast<float>(x);
  return d == DType::bf16 ? bf16_to_float(float_to_bf16(f)) : f16_to_float(float_to_f16(f));
}

double load(DType d, const void* p, int64_t i) {
  if (d == DType::bf16) return bf16_to_float(static_cast<const bf16*>(p)[i]);
  return f16_to_float(static_cast<const f16*>(p)[i]);
}

void store(DType d, void* p, int64_t i, double x) {
  if (d == DType::bf16) {
    static_cast<bf16*>(p)[i] = float_to_bf16(static_cast<float>(x));
  } else {
    static_cast<f16*>(p)[i] = float_to_f16(static_cast<float>(x));
  }
}

// Element offsets of the graphs' layouts (sdpa.h).
struct Layout {
  const SdpaShape& s;
  int64_t q(int64_t b, int64_t h, int64_t t) const {  // [B, H, T, D], also dQ
    return ((b * s.heads + h) * s.seq + t) * s.head_dim;
  }
  int64_t kv(int64_t b, int64_t h, int64_t t) const {  // [B, KV, T, D] for query head h
    return ((b * s.kv_heads + h / (s.heads / s.kv_heads)) * s.seq + t) * s.head_dim;
  }
  int64_t o(int64_t b, int64_t h, int64_t t) const {  // [B, T, H, D], also dO
    return ((b * s.seq + t) * s.heads + h) * s.head_dim;
  }
  int64_t first_key(int64_t t) const { return s.window > 0 ? std::max<int64_t>(0, t - s.window + 1) : 0; }
  double score(const void* q, const void* k, int64_t b, int64_t h, int64_t i, int64_t j) const {
    double dot = 0;
    for (int64_t x = 0; x < s.head_dim; ++x) {
      dot += load(s.dtype, q, this->q(b, h, i) + x) * load(s.dtype, k, kv(b, h, j) + x);
    }
    return dot / std::sqrt(static_cast<double>(s.head_dim));
  }
};

}  // namespace

std::string sdpa_declines(const ops::AttentionDims& d, DType compute) {
  if (!emu::fused_attention) return kOff;
  return sdpa_shape_declines(d, compute);
}

std::string validate_sdpa(const SdpaShape&, int) { return "no cuDNN on the emulated device"; }

struct SdpaRunner::Impl {};
SdpaRunner::SdpaRunner(CUstream_st*) {}
SdpaRunner::~SdpaRunner() = default;

std::string SdpaRunner::prepare(const SdpaShape&) { return emu::fused_attention ? "" : kOff; }

size_t SdpaRunner::forward_workspace(const SdpaShape&) const { return 0; }

size_t SdpaRunner::backward_workspace(const SdpaShape& s) const {
  return sdpa_backward_workspace_estimate(s);
}

void SdpaRunner::forward(const SdpaShape& s, const SdpaForward& io, void*) const {
  const Layout at{s};
  std::vector<double> scores(static_cast<size_t>(s.seq));
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.seq; ++i) {
        const int64_t first = at.first_key(i);
        double most = -INFINITY;
        for (int64_t j = first; j <= i; ++j) {
          scores[j] = at.score(io.q, io.k, b, h, i, j);
          most = std::max(most, scores[j]);
        }
        double sum = 0;
        for (int64_t j = first; j <= i; ++j) sum += std::exp(scores[j] - most);
        const double lse = most + std::log(sum);
        io.stats[(b * s.heads + h) * s.seq + i] = static_cast<float>(lse);
        for (int64_t x = 0; x < s.head_dim; ++x) {
          double acc = 0;
          for (int64_t j = first; j <= i; ++j) {
            acc += rounded(s.dtype, std::exp(scores[j] - lse)) *
                   load(s.dtype, io.v, at.kv(b, h, j) + x);
          }
          store(s.dtype, io.o, at.o(b, h, i) + x, acc);
        }
      }
    }
  }
}

void SdpaRunner::backward(const SdpaShape& s, const SdpaBackward& io, void*) const {
  const Layout at{s};
  const int64_t D = s.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> dq(static_cast<size_t>(s.batch * s.heads * s.seq * D));
  std::vector<double> dk(static_cast<size_t>(s.batch * s.kv_heads * s.seq * D)), dv(dk.size());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.seq; ++i) {
        double delta = 0;  // dO · O of the query
        for (int64_t x = 0; x < D; ++x) {
          delta += load(s.dtype, io.d_o, at.o(b, h, i) + x) * load(s.dtype, io.o, at.o(b, h, i) + x);
        }
        const double lse = io.stats[(b * s.heads + h) * s.seq + i];
        for (int64_t j = at.first_key(i); j <= i; ++j) {
          const double p = std::exp(at.score(io.q, io.k, b, h, i, j) - lse);
          double dp = 0;
          for (int64_t x = 0; x < D; ++x) {
            const double d_o = load(s.dtype, io.d_o, at.o(b, h, i) + x);
            dv[at.kv(b, h, j) + x] += rounded(s.dtype, p) * d_o;
            dp += d_o * load(s.dtype, io.v, at.kv(b, h, j) + x);
          }
          const double ds = rounded(s.dtype, p * (dp - delta)) * scale;
          for (int64_t x = 0; x < D; ++x) {
            dq[at.q(b, h, i) + x] += ds * load(s.dtype, io.k, at.kv(b, h, j) + x);
            dk[at.kv(b, h, j) + x] += ds * load(s.dtype, io.q, at.q(b, h, i) + x);
          }
        }
      }
    }
  }
  for (size_t i = 0; i < dq.size(); ++i) store(s.dtype, io.dq, static_cast<int64_t>(i), dq[i]);
  for (size_t i = 0; i < dk.size(); ++i) {
    store(s.dtype, io.dk, static_cast<int64_t>(i), dk[i]);
    store(s.dtype, io.dv, static_cast<int64_t>(i), dv[i]);
  }
}

}  // namespace cuda_emu
}  // namespace meshtrain
