// Model-state bytes per rank for each ZeRO stage: the closed-form formulas of
// docs/distributed.md, and the exact count for a layout (padding included).
//
// With Ψ parameters of which Ψn are bf16 matmul weights in bf16 precision
// (Ψn = 0 in fp32), Ψw = Ψ - Ψn, and N data-parallel ranks:
//   stage 0 (DDP):  params 4Ψ + 2Ψn   grads 4Ψ     optimizer 8Ψ
//   stage 1:        params 4Ψw + 2Ψn  grads 4Ψ     optimizer (8Ψ + 4Ψn) / N
//   stage 2:        params 4Ψw + 2Ψn  grads 4Ψ/N   optimizer (8Ψ + 4Ψn) / N
//   stage 3:  params (4Ψw + 2Ψn) / N  grads 4Ψ/N   optimizer (8Ψ + 4Ψn) / N
// Optimizer = exp_avg + exp_avg_sq, and the f32 master shards of bf16
// weights (a f32 weight's master shard is its compute values). Transient
// buffers (stage 2/3 unit gradients, stage 3 gathered units) are not counted.
#pragma once

#include <cstddef>
#include <cstdint>

#include "meshtrain/parallel/zero/flat_param.h"

namespace meshtrain::zero {

struct ModelStateBytes {
  size_t params = 0, grads = 0, optimizer = 0;
  size_t total() const { return params + grads + optimizer; }
};

// The formulas above (no padding). stage 0..3.
ModelStateBytes zero_formula_bytes(int stage, int64_t params, int64_t narrow_params, int dp);

// What ShardedDataParallel allocates per rank for `layout` (stage 1..3),
// padding included, with the optimizer state resident (offload tier none).
ModelStateBytes layout_model_state_bytes(const ZeroLayout& layout, int stage);

// With offload cpu/disk: the bytes per rank in the slower tier (MemCategory::offloaded).
// Stages 1/2 the optimizer state above; stage 3 the parameter shards too, which then
// leave `params`: per flat shard element 12 bytes (exp_avg, exp_avg_sq, f32 master) + the
// compute dtype's bytes for a 2-byte flat. What stays resident of the store is at most
// the budget (MemCategory::optimizer), plus the f32 gradient shards (grads above).
size_t layout_offloaded_bytes(const ZeroLayout& layout, int stage);

}  // namespace meshtrain::zero
