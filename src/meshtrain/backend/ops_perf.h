// `meshtrain ops perf`: every op of the ops layer timed at the shapes of one
// training step of a model (default: bench/train_vs_torch.sh's Llama, d512,
// 8 heads, SwiGLU 1536, GPT-2 vocabulary, seq 256, batch 8), with its rate
// (GFLOP/s for the matmul-bound ops, GB/s for the memory-bound ones) and the
// fraction of the backend's measured roofline: its matmul peak in the op's
// dtype, or the bandwidth of a copy moving as many bytes as the op does.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "meshtrain/backend/backend.h"

namespace meshtrain {

struct OpsPerfShape {
  int64_t batch = 8, seq = 256, dim = 512, heads = 8, kv_heads = 8, hidden = 1536, vocab = 50257;
};

struct OpsPerfOptions {
  std::string op_regex;  // "" = every op
  OpsPerfShape shape;
  double seconds = 0.3;  // per case, after one warm-up call
};

struct OpsPerfRow {
  std::string op, params;
  double ms = 0;        // median of the timed calls
  double rate = 0;      // GFLOP/s or GB/s
  bool flops = false;   // which one `rate` is
  double roofline = 0;  // rate / the backend's peak of that kind
};

// Measures the backend's peaks first (printed), then every case (one line each).
std::vector<OpsPerfRow> run_ops_perf(Backend& backend, const OpsPerfOptions& options,
                                     std::FILE* out);

}  // namespace meshtrain
