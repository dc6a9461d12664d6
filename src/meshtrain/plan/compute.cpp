#include "meshtrain/plan/compute.h"

#include <algorithm>

#include "meshtrain/plan/option_names.h"
#include "meshtrain/plan/transformer.h"

namespace meshtrain::plan {

namespace {
constexpr OptionNames<Attention, 2> kAttention{"--attention", {"flash", "unfused"}};
}  // namespace

std::string_view attention_name(Attention a) { return kAttention.name(a); }
Attention parse_attention(std::string_view name) { return kAttention.parse(name); }

double batched_gemm_seconds(double batch, double m, double n, double k, double bytes,
                            const GpuSpec& gpu) {
  const double math = 2 * m * n * k / (gpu.peak_flops * gpu.gemm_efficiency);
  const double traffic = bytes * (m * k + k * n + m * n) / (gpu.hbm_bandwidth * gpu.memory_efficiency);
  return batch * std::max(math, traffic) + gpu.kernel_overhead_seconds;
}

double gemm_seconds(double m, double n, double k, double bytes, const GpuSpec& gpu) {
  return batched_gemm_seconds(1, m, n, k, bytes, gpu);
}

double gemm_fraction(double m, double n, double k, double bytes, const GpuSpec& gpu) {
  return 2 * m * n * k / (gemm_seconds(m, n, k, bytes, gpu) * gpu.peak_flops);
}

double memory_seconds(double bytes, const GpuSpec& gpu) {
  return bytes / (gpu.hbm_bandwidth * gpu.memory_efficiency) + gpu.kernel_overhead_seconds;
}

void OpsTime::add(OpTime op) {
  forward += op.forward;
  backward += op.backward;
  recompute += op.recompute;
  weight += op.weight;
  ops.push_back(std::move(op));
}

namespace {

struct Sizes {
  double tokens;       // b s / cp: rows of every GEMM on this rank
  double norm_tokens;  // tokens / tp with sequence parallelism
  double t, e;
};

Sizes sizes(const ComputeShape& x) {
  const double tokens = static_cast<double>(x.micro_batch * x.seq) / static_cast<double>(x.cp);
  const double t = static_cast<double>(x.tp);
  return {tokens, x.sequence_parallel ? tokens / t : tokens, t, x.value_bytes};
}

// A linear layer y[T, out] = x[T, in] W[in, out] on this rank: forward, then
// the data gradient dx = dy W^T and the weight gradient dW = x^T dy (none when
// W is frozen). Adapted (LoRA): + x A, (xA) B forward and their four backward
// GEMMs; QLoRA: W is dequantised (read NF4, write bf16) for forward and backward.
struct LinearContext {
  const GpuSpec& gpu;
  double tokens, e;
  bool recomputed;
  const Finetune& finetune;
  int64_t tp = 1;
  bool fp8 = false;
};

OpTime linear(std::string name, double in, double out, bool adapted, const LinearContext& c) {
  const double T = c.tokens, e = c.e;
  OpTime op{std::move(name), 2 * T * in * out};
  // FP8: the GEMMs at the FP8 peak on 1-byte operands; the input (forward)
  // and the output gradient (backward) are quantised first.
  GpuSpec gemm = c.gpu;
  double operand = e;
  if (c.fp8) {
    gemm.peak_flops = c.gpu.fp8_peak_flops;
    operand = 1;
    op.forward += memory_seconds(T * in * (e + 1), c.gpu);
    op.backward += memory_seconds(T * out * (e + 1), c.gpu);
  }
  op.forward += gemm_seconds(T, out, in, operand, gemm);
  op.backward += gemm_seconds(T, in, out, operand, gemm);
  const Finetune& f = c.finetune;
  if (!f.adapters()) {
    op.weight = gemm_seconds(in, out, T, operand, gemm);
    op.backward += op.weight;
  } else {
    if (f.method == FinetuneMethod::qlora) {
      const double dequant = memory_seconds(in * out * (frozen_weight_bytes(f, c.tp) + e), c.gpu);
      op.forward += dequant;
      op.backward += dequant;
    }
    if (adapted) {
      const double r = static_cast<double>(f.rank);
      op.forward += gemm_seconds(T, r, in, e, c.gpu) + gemm_seconds(T, out, r, e, c.gpu);
      op.backward += gemm_seconds(T, r, out, e, c.gpu) + gemm_seconds(r, out, T, e, c.gpu) +
                     gemm_seconds(T, in, r, e, c.gpu) + gemm_seconds(in, r, T, e, c.gpu);
    }
  }
  if (c.recomputed) op.recompute = op.forward;
  return op;
}

// A memory-bound elementwise op moving `bytes` forward; its backward reads the
// incoming gradient and the saved input and writes the outgoing one (2x).
OpTime streaming(std::string name, double bytes, const GpuSpec& gpu, bool recomputed) {
  OpTime op{std::move(name), 0};
  op.forward = memory_seconds(bytes, gpu);
  op.backward = 2 * op.forward;
  if (recomputed) op.recompute = op.forward;
  return op;
}

}  // namespace

OpsTime layer_time(const ModelConfig& c, const GpuSpec& gpu, const ComputeShape& x) {
  const Sizes z = sizes(x);
  const double h = static_cast<double>(c.dim), f = active_mlp_width(c);
  const AttentionShape a = attention_shape(c);
  const bool swiglu = c.recipe().feed_forward == FeedForward::swiglu;
  const bool full = x.recompute == Recompute::full;
  OpsTime out;
  const double T = z.tokens, t = z.t, e = z.e;
  const LinearContext lc{gpu, T, e, full, x.finetune, x.tp, x.fp8};
  const bool all = x.finetune.targets == LoraTargets::all;
  // A projection on this rank: tp cuts its output or its input, or neither.
  // Selective recomputation repeats MLA's up-projections from the latents.
  auto project = [&](const AttentionShape::Projection& p, bool adapted) {
    using Split = AttentionShape::Split;
    OpTime op = linear(p.name, p.split == Split::in ? p.in / t : p.in,
                       p.split == Split::out ? p.out / t : p.out, adapted, lc);
    if (p.from_latent && x.recompute == Recompute::selective) op.recompute = op.forward;
    return op;
  };

  out.add(streaming("norms (2)", 2 * 2 * z.norm_tokens * h * e, gpu, full));
  for (const AttentionShape::Projection& p : a.in) out.add(project(p, true));
  if (a.latent > 0) out.add(streaming("latent norms (2)", T * a.latent * e, gpu, full));
  if (a.rope > 0) out.add(streaming("rope", 2 * T * a.rope / t * e, gpu, full));

  if (x.attention == Attention::flash) {
    // Flash attention: causal, so half of the 2 b s^2 (qk + values) FLOPs of
    // scores and weighted sum; with cp ranks each computes 1/cp of it
    // (load-balanced chunks). Backward: 5 GEMMs against 2 (dV, dP, dQ, dK and
    // the recomputed scores), unless the scores were stored (recompute none).
    const double keys = c.attention_seq(static_cast<double>(x.seq));
    OpTime attention{"attention", 0.5 * 2 * T * keys * (a.qk + a.values()) / t};
    attention.forward = attention.flops / (gpu.peak_flops * gpu.attention_efficiency);
    attention.backward = (x.recompute == Recompute::none ? 2.0 : 2.5) * attention.forward;
    if (full) attention.recompute = attention.forward;
    out.add(attention);
  } else {
    // Unfused: per head, scores S = Q K^T (s_q x s x d_qk), softmax and dropout
    // over S, then S V (d_v); backward two GEMMs per product and the streams
    // again (2x). Selective recomputation repeats the whole core forward.
    const double heads = static_cast<double>(x.micro_batch) * a.heads / t;
    const double sq = static_cast<double>(x.seq) / static_cast<double>(x.cp);
    const double sk = static_cast<double>(x.seq);
    const bool again = x.recompute != Recompute::none;
    auto product = [&](std::string name, double m, double n, double k) {
      OpTime op{std::move(name), 2 * heads * m * n * k};
      op.forward = batched_gemm_seconds(heads, m, n, k, e, gpu);
      op.backward = batched_gemm_seconds(heads, m, k, n, e, gpu) +
                    batched_gemm_seconds(heads, k, n, m, e, gpu);
      if (again) op.recompute = op.forward;
      return op;
    };
    const double scores = heads * sq * sk;
    out.add(product("scores QK^T", sq, sk, a.qk / a.heads));
    out.add(streaming("softmax", 2 * scores * e, gpu, again));
    if (x.dropout) out.add(streaming("attn dropout", scores * (2 * e + 1), gpu, again));
    out.add(product("scores x V", sq, a.values() / a.heads, sk));
  }

  out.add(project(a.out, all));
  out.add(streaming("residuals (2)", 2 * 3 * z.norm_tokens * h * e, gpu, full));
  out.add(linear(swiglu ? "gate|up" : "fc1", h,
                 static_cast<double>(c.recipe().ff_in_factor()) * f / t, all, lc));
  // SwiGLU reads gate and up and writes their product; GELU reads and writes.
  // Selective recomputation (SwiGLU) keeps only gate|up and recomputes the product.
  OpTime act = streaming(swiglu ? "swiglu" : "gelu", (swiglu ? 3 : 2) * T * f / t * e, gpu,
                         full || (swiglu && x.recompute == Recompute::selective));
  out.add(act);
  out.add(linear(swiglu ? "down" : "fc2", f / t, h, all, lc));
  if (const MoeConfig& m = c.moe; m.enabled()) {
    // Mixture of experts (the MLP GEMMs above ran at the active width, as a
    // grouped GEMM does): the f32 router and the permute / unpermute of the
    // top_k copies of each token, averaged over the layers like the rest.
    const TransformerCounts n = count_transformer(c);
    const double share = n.moe_layers / static_cast<double>(c.n_layers);
    const double E = static_cast<double>(m.experts), k = static_cast<double>(m.top_k);
    OpTime router{"router", share * 2 * T * h * E};
    router.forward = share * gemm_seconds(T, E, h, 4, gpu);
    router.backward = share * 2 * gemm_seconds(T, E, h, 4, gpu);
    if (full) router.recompute = router.forward;
    out.add(router);
    OpTime moves = streaming("permute + unpermute", share * 2 * 2 * T * k * h * e, gpu, full);
    out.add(moves);
  }
  if (x.dropout) out.add(streaming("dropout (2)", 2 * z.norm_tokens * h * (2 * e + 1), gpu, full));
  return out;
}

OpsTime embedding_time(const ModelConfig& c, const GpuSpec& gpu, const ComputeShape& x) {
  const Sizes z = sizes(x);
  OpsTime out;
  OpTime lookup = streaming("embedding", 2 * z.norm_tokens * static_cast<double>(c.dim) * z.e,
                            gpu, false);
  lookup.backward = memory_seconds(z.norm_tokens * static_cast<double>(c.dim) * 4 * 2, gpu);
  out.add(lookup);
  return out;
}

OpsTime head_time(const ModelConfig& c, const GpuSpec& gpu, const ComputeShape& x) {
  const Sizes z = sizes(x);
  const double h = static_cast<double>(c.dim), vocab = static_cast<double>(c.vocab_size);
  OpsTime out;
  Finetune frozen_head = x.finetune;  // QLoRA keeps the output layer in bf16
  if (frozen_head.method == FinetuneMethod::qlora) frozen_head.method = FinetuneMethod::lora;
  // The output layer (16-bit, tp-split vocabulary) and the fp32 loss: softmax
  // reads the logits and writes the probabilities; the gradient is
  // probabilities minus one-hot, written in the compute dtype.
  auto output_and_loss = [&](const std::string& prefix) {
    out.add(linear(prefix + "output", h, vocab / z.t, false,
                   {gpu, z.tokens, z.e, false, frozen_head}));
    OpTime loss = streaming(prefix + "cross-entropy", z.tokens * vocab / z.t * (4 + 4), gpu, false);
    loss.backward = memory_seconds(z.tokens * vocab / z.t * (4 + z.e), gpu);
    out.add(loss);
  };
  out.add(streaming("final norm", 2 * z.norm_tokens * h * z.e, gpu, false));
  output_and_loss("");
  // Multi-token prediction (DeepSeek-V3 section 2.2): each module normalises
  // the hidden state and the next token's embedding, projects their
  // concatenation (2h -> h), runs one block and the shared output layer.
  for (int64_t d = 0; d < x.mtp; ++d) {
    out.add(streaming("mtp norms (3)", 3 * 2 * z.norm_tokens * h * z.e, gpu, false));
    out.add(linear("mtp proj", 2 * h, h, false, {gpu, z.tokens, z.e, false, x.finetune, x.tp, x.fp8}));
    const OpsTime block = layer_time(c, gpu, x);
    OpTime whole{"mtp block", 0};
    for (const OpTime& op : block.ops) whole.flops += op.flops;
    whole.forward = block.forward;
    whole.backward = block.backward;
    whole.recompute = block.recompute;
    whole.weight = block.weight;
    out.add(whole);
    output_and_loss("mtp ");
  }
  return out;
}

}  // namespace meshtrain::plan
