// Fine-tuning memory against the LoRA and QLoRA papers, and the failure model
// (Young / Daly checkpoint interval, goodput) against its closed forms.
#include <gtest/gtest.h>

#include <cmath>

#include "llama405b.h"
#include "meshtrain/plan/failures.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/plan/planner.h"

namespace meshtrain::plan {
namespace {

constexpr double kGB = 1e9;

struct OneGpu {
  PlanContext ctx;
  Cluster cluster;
  Job job;
  Layout layout;
};

OneGpu one_gpu(const ModelConfig& model, FinetuneMethod method, int64_t rank, double hbm_bytes,
               int64_t seq) {
  OneGpu g;
  g.job.seq = seq;
  g.job.global_batch = 1;
  g.job.tokens = 1e6;
  g.job.checkpoint_interval_seconds = 0;
  g.job.finetune.method = method;
  g.job.finetune.rank = rank;
  g.ctx = make_context(model, g.job);
  GpuSpec gpu = gpu_spec("a100-80gb");
  gpu.hbm_bytes = hbm_bytes;
  g.cluster = make_cluster(gpu, 1, 8);
  g.layout.recompute = Recompute::full;  // gradient checkpointing, as QLoRA trains
  return g;
}

TEST(Finetune, Nf4WithDoubleQuantisationIs4127BitsPerWeight) {
  // QLoRA section 3: 4 bits + 8-bit block scales per 64 + fp32 per 256 blocks.
  EXPECT_NEAR(kNf4DoubleQuantBits, 4.127, 5e-4);
  Finetune q{FinetuneMethod::qlora};
  EXPECT_DOUBLE_EQ(frozen_weight_bytes(q), kNf4DoubleQuantBits / 8);
  EXPECT_DOUBLE_EQ(frozen_weight_bytes(q, 2), 4.5 / 8);  // a tp slice's f32 block scales
  EXPECT_DOUBLE_EQ(frozen_weight_bytes(Finetune{FinetuneMethod::lora}), 2.0);
}

TEST(Finetune, LoraPaperTrainableParametersOfGpt3) {
  // Hu et al. 2021, table 4: GPT-3 175B with W_q and W_v adapted: 4.7M
  // trainable parameters at r = 1 and 37.7M at r = 8.
  const ModelConfig gpt3 = gpt_dense(96, 12288, 96, 50257, 2048);
  Finetune f{FinetuneMethod::lora, 8, LoraTargets::qv};
  EXPECT_NEAR(96 * lora_layer_params(gpt3, f) / 37.7e6, 1.0, 0.01);
  f.rank = 1;
  EXPECT_NEAR(96 * lora_layer_params(gpt3, f) / 4.7e6, 1.0, 0.01);
}

TEST(Finetune, LoraPaperGpt3MemoryIsTheFrozenWeights) {
  // Hu et al. 2021, section 4.2: LoRA on GPT-3 175B needs 350 GB of VRAM in
  // training (the bf16 weights) against 1.2 TB for full fine-tuning, and its
  // checkpoint shrinks from 350 GB to 35 MB (r = 4, W_q and W_v).
  const ModelConfig gpt3 = gpt_dense(96, 12288, 96, 50257, 2048);
  OneGpu g = one_gpu(gpt3, FinetuneMethod::lora, 4, 1e15, 2048);
  g.job.finetune.targets = LoraTargets::qv;
  const Estimate e = evaluate(g.ctx, g.cluster, g.job, g.layout);
  const double states = e.memory.params + e.memory.grads + e.memory.optimizer;
  EXPECT_NEAR(states / (350 * kGB), 1.0, 0.02);
  EXPECT_NEAR(e.trainable_params * 2 / (35 * 1024 * 1024), 1.0, 0.1);  // the bf16 adapters
  g.job.finetune.method = FinetuneMethod::full;
  const Estimate full = evaluate(g.ctx, g.cluster, g.job, g.layout);
  EXPECT_GT(full.memory.params + full.memory.grads + full.memory.optimizer, 1200 * kGB);
}

TEST(Finetune, QloraFitsLlama65bOnOne48GbGpu) {
  // Dettmers et al. 2023: QLoRA fine-tunes a 65B model on a single 48 GB GPU
  // (r = 64 on every linear, gradient checkpointing, paged optimizer: the
  // adapters' AdamW state pages out to the host), where 16-bit fine-tuning
  // needs more than 780 GB.
  const ModelConfig llama65 = plan_model("llama1-65b").config;
  OneGpu g = one_gpu(llama65, FinetuneMethod::qlora, 64, 48 * kGB, 512);
  g.layout.offload = Offload::optimizer;
  const Estimate q = evaluate(g.ctx, g.cluster, g.job, g.layout);
  EXPECT_TRUE(q.fits) << q.memory.device_total() / kGB << " GB";
  // The 4-bit base is most of it: 64.8B GEMM weights x 4.127 bits + 0.5B bf16.
  EXPECT_NEAR(q.memory.params / kGB, 64.76 * 4.127 / 8 + 0.52 * 2 + 0.80 * 2, 0.5);
  EXPECT_GT(q.memory.device_total(), 35 * kGB);
  // Without paging the optimizer state it does not fit; bf16 LoRA does not either.
  g.layout.offload = Offload::none;
  EXPECT_FALSE(evaluate(g.ctx, g.cluster, g.job, g.layout).fits);
  g.job.finetune.method = FinetuneMethod::lora;
  EXPECT_FALSE(evaluate(g.ctx, g.cluster, g.job, g.layout).fits);
  g.job.finetune.method = FinetuneMethod::full;
  const Estimate full = evaluate(g.ctx, g.cluster, g.job, g.layout);
  EXPECT_GT(full.memory.params + full.memory.grads + full.memory.optimizer, 780 * kGB);
}

TEST(Finetune, AdaptersSkipTheFrozenWeightGradients) {
  const ModelConfig llama8 = plan_model("llama3-8b").config;
  OneGpu g = one_gpu(llama8, FinetuneMethod::full, 16, 1e12, 4096);
  const Estimate full = evaluate(g.ctx, g.cluster, g.job, g.layout);
  g.job.finetune.method = FinetuneMethod::lora;
  const Estimate lora = evaluate(g.ctx, g.cluster, g.job, g.layout);
  g.job.finetune.method = FinetuneMethod::qlora;
  const Estimate qlora = evaluate(g.ctx, g.cluster, g.job, g.layout);
  // No weight gradients: the backward is about half; QLoRA pays dequantisation.
  EXPECT_LT(lora.step_seconds, 0.85 * full.step_seconds);
  EXPECT_GT(qlora.step_seconds, lora.step_seconds);
  EXPECT_LT(lora.model_flops_per_step, full.model_flops_per_step);
}

TEST(Failures, Llama3DefaultRate) {
  EXPECT_DOUBLE_EQ(FailureModel{}.failures_per_gpu_hour, 419.0 / (54 * 24 * 16384.0));
}

TEST(Failures, YoungAndDalyIntervalsAreTheirClosedForms) {
  const double delta = 60, mtbf = 3 * 3600;
  EXPECT_DOUBLE_EQ(young_interval(delta, mtbf), std::sqrt(2 * delta * mtbf));
  const double x = delta / (2 * mtbf);
  EXPECT_DOUBLE_EQ(daly_interval(delta, mtbf),
                   std::sqrt(2 * delta * mtbf) * (1 + std::sqrt(x) / 3 + x / 9) - delta);
  EXPECT_DOUBLE_EQ(daly_interval(3 * mtbf, mtbf), mtbf);  // delta >= 2M: checkpoint every MTBF
  // Daly's interval minimises his wall time.
  const double tau = daly_interval(delta, mtbf), solve = 1e6, restart = 600;
  const double best = daly_wall_seconds(solve, tau, delta, restart, mtbf);
  for (double f : {0.7, 0.9, 1.1, 1.4}) {
    EXPECT_LT(best, daly_wall_seconds(solve, f * tau, delta, restart, mtbf));
  }
  // First order in tau/M: Ts (1 + delta/tau + (tau/2 + delta/2 + R) / M).
  const double m2 = 100 * 3600, d2 = 10, r2 = 60, t2 = daly_interval(d2, m2);
  const double first = solve * (1 + d2 / t2 + (t2 / 2 + d2 / 2 + r2) / m2);
  EXPECT_NEAR(daly_wall_seconds(solve, t2, d2, r2, m2) / first, 1.0, 1e-3);
}

TEST(Failures, GoodputOfA16kGpuRun) {
  // Llama 3 405B on 16,384 H100s: the job's MTBF is 1/(rate x GPUs) = 3.1 h.
  Llama405b x = llama405b_at(8192, 16384);
  Job& job = x.job;
  job.tokens = 15.6e12;
  job.checkpoint_interval_seconds = -1;  // Daly's optimum
  const PlanContext& ctx = x.ctx;
  const Cluster& cl = x.cluster;
  const Layout l = llama405b_layout(1, 128);
  const Estimate e = evaluate(ctx, cl, job, l);
  const double mtbf = 1 / (job.failures.failures_per_gpu_hour * 16384 / 3600);
  EXPECT_NEAR(e.goodput.mtbf_seconds, mtbf, 1e-9 * mtbf);
  EXPECT_NEAR(mtbf / 3600, 54.0 * 24 / 419, 1e-9);
  EXPECT_DOUBLE_EQ(e.goodput.interval_seconds, daly_interval(e.checkpoint_seconds, mtbf));
  EXPECT_LT(e.goodput.goodput, 1.0);
  EXPECT_GT(e.goodput.goodput, 0.8);
  EXPECT_GT(e.goodput.wall_seconds, e.train_seconds - e.steps * e.time.checkpoint);
  EXPECT_NEAR(e.goodput.failures, e.goodput.wall_seconds / mtbf, 1e-9 * e.goodput.failures);
  EXPECT_GT(e.wall_cost, e.cost * 0.999);
}

}  // namespace
}  // namespace meshtrain::plan
