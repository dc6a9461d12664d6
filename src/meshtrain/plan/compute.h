// Time of one micro-batch's work from its shapes: every GEMM on a roofline
// (the GPU's achievable fraction of peak, an HBM-bound floor, a fixed cost per
// kernel), flash attention at its own efficiency, norms / activations / RoPE /
// residuals / loss at HBM bandwidth. Per layer and for the embedding and
// head+loss ends, so pipeline stages can be costed and balanced.
// Formulas and sources: docs/plan.md, "Compute".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/model/config.h"
#include "meshtrain/plan/finetune.h"
#include "meshtrain/plan/hardware.h"
#include "meshtrain/plan/memory.h"

namespace meshtrain::plan {

// How the attention core runs: FlashAttention (tiled, causal half, scores never
// stored), or unfused as in Megatron-LM before it (Narayanan et al. 2021,
// Korthikanti et al. 2022): batched QK^T and PV GEMMs over the full s x s
// scores, with fused scale-mask-softmax and dropout kernels streaming them.
enum class Attention { flash, unfused };
std::string_view attention_name(Attention a);
Attention parse_attention(std::string_view name);

// Seconds for C[M,N] = A[M,K] B[K,N] in `bytes`-sized values:
//   max(2MNK / (peak * gemm_efficiency), bytes (MK + KN + MN) / (HBM * memory_efficiency))
//   + kernel_overhead.
double gemm_seconds(double m, double n, double k, double bytes, const GpuSpec& gpu);
// Achieved fraction of peak of that GEMM: 2MNK / (seconds * peak).
double gemm_fraction(double m, double n, double k, double bytes, const GpuSpec& gpu);
// A streaming (memory-bound) kernel that moves `bytes` through HBM.
double memory_seconds(double bytes, const GpuSpec& gpu);
// `batch` independent GEMMs in one kernel (one overhead).
double batched_gemm_seconds(double batch, double m, double n, double k, double bytes,
                            const GpuSpec& gpu);

// One micro-batch on one rank: `seq` is the full sequence, split over cp ranks.
struct ComputeShape {
  int64_t seq = 0, micro_batch = 1, tp = 1, cp = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::selective;
  bool dropout = false;
  double value_bytes = 2;
  // Fine-tuning: frozen base weights have no weight gradient; QLoRA dequantises
  // each NF4 weight to bf16 before its GEMMs; adapters add two thin GEMMs.
  Finetune finetune;
  Attention attention = Attention::flash;
  // The blocks' linear GEMMs in FP8 (DeepSeek-V3's recipe, section 3.3):
  // e4m3 inputs with fine-grained scales at the GPU's FP8 peak, each input and
  // output gradient quantised on the way; attention, router, norms, the
  // embedding and the output layer stay 16-bit.
  bool fp8 = false;
  // Multi-token-prediction modules trained with the model (DeepSeek-V3: 1),
  // on the last stage with the output layer they share.
  int64_t mtp = 0;
};

struct OpTime {
  std::string name;
  double flops = 0;  // per pass as executed (causal attention: the half it computes)
  double forward = 0, backward = 0, recompute = 0;  // seconds
  double weight = 0;  // of backward, the weight gradient's GEMM (what DualPipe defers)
  double total() const { return forward + backward + recompute; }
};

struct OpsTime {
  std::vector<OpTime> ops;
  double forward = 0, backward = 0, recompute = 0, weight = 0;
  double total() const { return forward + backward + recompute; }
  void add(OpTime op);
};

// One transformer block: qkv, attention, o-proj, MLP GEMMs (forward, data and
// weight gradients), flash attention (backward 2.5x forward; none: 2x, the
// scores are stored), memory-bound norms, residuals, RoPE, activation, dropout.
// Recomputation repeats: selective the MLP activation (llama: from the kept
// gate|up output) and, for latent attention, the up-projections q_b and kv_b
// from the kept latents (DeepSeek-V3 section 3.2.3); full the whole forward. With adapters: the base GEMMs lose
// their weight gradient, QLoRA adds a dequantisation per weight and pass, and
// each adapted linear adds x A (T x r) and (xA) B.
OpsTime layer_time(const ModelConfig& model, const GpuSpec& gpu, const ComputeShape& shape);
// Token embedding lookup (and its scatter-add gradient).
OpsTime embedding_time(const ModelConfig& model, const GpuSpec& gpu, const ComputeShape& shape);
// Final norm, output GEMM (tp-split vocabulary), fp32 softmax cross-entropy;
// then each multi-token-prediction module (shape.mtp): its norms, projection,
// one block and the shared output layer with its own loss.
OpsTime head_time(const ModelConfig& model, const GpuSpec& gpu, const ComputeShape& shape);

}  // namespace meshtrain::plan
