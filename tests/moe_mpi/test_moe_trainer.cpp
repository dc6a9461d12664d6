// Mixture-of-experts models through whole Trainer runs under mpirun: every
// layout of the same global batch and micro-batches equals one rank (loss
// trace within 1e-5, final weights within 1e-5) — dp 2 with ZeRO 0, 1 and 3,
// pp 2 1F1B, and full recomputation — and a checkpoint resumes bit for bit.
// The model routes with top-2 of 4 experts, a gated shared expert, a dense
// first layer, the load-balancing and z losses (the auxiliary losses'
// gradients enter in backward on every layout) and a capacity of 1.25 times
// the mean load (over-full experts drop choices). The routing statistics,
// summed over the dp ranks, reach metrics.jsonl and the report's plots; the
// trace has the route, dispatch, experts and combine spans. Expert
// parallelism (ep 2 and 4 over dp 2 and 4, with recompute and with pp 2)
// equals one rank too, and its checkpoints resume at any ep.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>

#include "meshtrain/ckpt/hf.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/report/run_report.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/memory_expect.h"
#include "support/scratch.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

// Tolerances: fp32 by default; bf16 runs whose layouts round differently
// (tp's partial sums) within bf16 rounding, as the dense tp tests.
using Tolerance = testing::RunTolerance;

class MoeTrainer : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::shared_phrase_corpus(*world_, 61); }

  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    return testing::tiny_run_config(R"(
[model]
family = "llama"
dim = 32
n_layers = 4
n_heads = 4
n_kv_heads = 2
hidden_dim = 48
vocab_size = 61
max_seq_len = 32
tie_embeddings = false
[moe]
experts = 4
top_k = 2
hidden_dim = 24
shared_hidden = 16
shared_gate = true
first_dense = 1
aux_loss = 0.01
z_loss = 0.001
capacity_factor = 1.25
[train]
steps = 16
batch_size = 8
micro_batch_size = 2
seq_len = 16
threads = 1
grad_clip = 1.0
eval_interval = 8
eval_batches = 1
peak_flops = 1e11
checkpoint_interval = -1
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
[data]
tokenizer = "bytes"
)",
                                    dir_, out, std::move(extra), "moe.toml");
  }

  // The single-rank reference, every rank alone in its own directory.
  testing::TrainerRun reference(const std::string& name, ConfigOverrides extra = {}) const {
    return testing::run_trainer(
        config(fmt::format("{}.rank{}", name, world_->rank()), std::move(extra)), nullptr);
  }

  void expect_close(const testing::TrainerRun& got, const testing::TrainerRun& ref,
                    const std::string& what, Tolerance tol = Tolerance()) {
    testing::expect_runs_close(got, ref, what, tol, "moe", world_->rank() == 0);
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(MoeTrainer, DataParallelAndZeroEqualOneRank) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  const testing::TrainerRun ref = reference("ref");
  DeviceMesh mesh(*world_, 1, 1);
  for (const char* zero : {"0", "1", "3"}) {
    const testing::TrainerRun got =
        testing::run_trainer(config(fmt::format("dp2_z{}", zero), {{"parallel.zero", zero}}), &mesh);
    expect_close(got, ref, fmt::format("dp 2 ZeRO-{}", zero));
    testing::expect_memory_matches(got.predicted, got.memory, fmt::format("MoE dp 2 ZeRO-{}", zero));
  }
}

// Every step's record holds each MoE layer's expert load over the whole
// global batch (dp ranks summed): top_k choices per token.
TEST_F(MoeTrainer, RoutingStatisticsReachMetricsAndTheReport) {
  std::unique_ptr<DeviceMesh> mesh;
  if (world_->size() == 2) mesh = std::make_unique<DeviceMesh>(*world_, 1, 1);
  const std::string out = world_->size() == 2 ? "stats" : fmt::format("stats.rank{}", world_->rank());
  const testing::TrainerRun run =
      testing::run_trainer(config(out, {{"train.trace_steps", "2"}}), mesh.get());
  const double per_step = 8 * 16 * 2;  // batch x seq tokens, top 2
  int64_t dropped = 0;
  for (const StepRecord& r : run.records) {
    ASSERT_EQ(r.moe.size(), 3u) << "layers 1, 2, 3 (layer 0 dense)";
    for (const MoeLayerRecord& m : r.moe) {
      EXPECT_DOUBLE_EQ(m.tokens_mean * 4, per_step) << "step " << r.step << " layer " << m.layer;
      EXPECT_LE(m.tokens_min, m.tokens_mean);
      EXPECT_GE(m.imbalance, 1.0);
      EXPECT_GT(m.aux, 0.5);
      EXPECT_GT(m.z, 0.0);
      dropped += m.dropped;
    }
  }
  EXPECT_GT(dropped, 0) << "capacity 1.25 x the mean load drops some choices";
  world_->barrier();
  if (world_->rank() != 0) return;
  const std::string text = testing::read_file(dir_ + "/" + out + "/metrics.jsonl");
  EXPECT_NE(text.find("\"moe\":[{\"aux\":"), std::string::npos) << text.substr(0, 600);
  const nlohmann::json summary = report::summarize_run(dir_ + "/" + out);
  ASSERT_EQ(summary["moe"].size(), 3u);
  EXPECT_EQ(summary["moe"][0]["layer"], 1);
  EXPECT_EQ(summary["moe"][0]["step"].size(), 16u);
  const std::string html = report::render_html(summary);
  EXPECT_NE(html.find("id=\"plot-moe-load\""), std::string::npos);
  EXPECT_NE(html.find("data-series=\"layer 3\""), std::string::npos);
  // The trace shows the MoE steps as their own spans, forward and backward.
  const std::string trace = testing::read_file(dir_ + "/" + out + "/trace/rank_0.json");
  for (const char* span : {"route 1", "dispatch 1", "experts 3", "combine 3", "shared experts 2",
                           "experts backward", "combine backward", "route backward"}) {
    EXPECT_NE(trace.find(fmt::format("\"name\":\"{}\"", span)), std::string::npos) << span;
  }
}

// DeepSeek-V3's balancing through whole runs: dp 2 (ZeRO 0 and 1) equals one
// rank, resume is bit for bit (the bias is in the checkpoint), and the bias
// moves: it routed step 16 differently from step 1.
TEST_F(MoeTrainer, BiasBalancingEqualsOneRankAndResumes) {
  const ConfigOverrides biased{{"moe.bias_update_rate", "0.01"}, {"moe.aux_loss", "0"}};
  const testing::TrainerRun ref = reference("bias_ref", biased);
  ASSERT_EQ(ref.records.size(), 16u);
  EXPECT_EQ(ref.records.front().moe[0].bias_max, 0.0);
  EXPECT_GT(ref.records.back().moe[0].bias_max, 0.0);
  EXPECT_LT(ref.records.back().moe[0].bias_min, 0.0);
  testing::expect_memory_matches(ref.predicted, ref.memory, "MoE bias balancing one rank");
  if (world_->size() == 2) {
    DeviceMesh mesh(*world_, 1, 1);
    for (const char* zero : {"0", "1", "3"}) {
      ConfigOverrides o = biased;
      o.emplace_back("parallel.zero", zero);
      const testing::TrainerRun got =
          testing::run_trainer(config(fmt::format("bias_dp2_z{}", zero), o), &mesh);
      expect_close(got, ref, fmt::format("bias balancing dp 2 ZeRO-{}", zero));
    }
    return;
  }
  ConfigOverrides with_ckpt = biased;
  with_ckpt.emplace_back("train.checkpoint_interval", "8");
  const std::string name = fmt::format("bias_resume.rank{}", world_->rank());
  const testing::TrainerRun full = testing::run_trainer(config(name, with_ckpt));
  const testing::TrainerRun rest =
      testing::run_trainer(config(name + "_rest", biased), nullptr, dir_ + "/" + name + "/step_8");
  ASSERT_EQ(rest.records.size(), 8u);
  for (size_t i = 0; i < rest.records.size(); ++i) {
    EXPECT_EQ(rest.records[i].loss, full.records[8 + i].loss) << "step " << rest.records[i].step;
  }
  EXPECT_EQ(0, std::memcmp(rest.weights.data(), full.weights.data(), full.weights.size() * 4));
}

// train.init_from each MoE family that transformers wrote (per-expert tensors,
// their attention options): the model comes from its config.json, and dp 2,
// ZeRO-3, ep 2, pp 2 and (where the QK-norm allows) tp 2 start from the same weights
// and follow the one-rank run.
class MoeFamilies : public MoeTrainer, public ::testing::WithParamInterface<const char*> {};

TEST_P(MoeFamilies, InitFromAHuggingFaceCheckpointUnderEveryLayout) {
  const std::string family = GetParam();
  const std::string hf =
      std::string(MESHTRAIN_SOURCE_DIR) + "/tests/reference/fixtures/hf_tiny_" + family;
  auto from_hf = [&](const std::string& out, ConfigOverrides extra) {
    extra.emplace_back("train.init_from", hf);
    return testing::tiny_run_config(std::string(R"(
[optim]
lr = 1e-3
warmup_steps = 1
[train]
steps = 6
batch_size = 4
micro_batch_size = 2
seq_len = 16
)") + testing::kQuietRunTail,
                                    dir_, family + "_" + out, std::move(extra), "init_from.toml");
  };
  const testing::TrainerRun ref = testing::run_trainer(
      from_hf(fmt::format("ref.rank{}", world_->rank()), {}), nullptr);
  ASSERT_EQ(ref.records.size(), 6u);
  EXPECT_TRUE(std::isfinite(ref.records.back().loss));
  const ModelConfig c = read_hf_config(hf + "/config.json");
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.n_layers; ++l) moe_layers += c.moe.is_moe_layer(l) ? 1 : 0;
  ASSERT_EQ(static_cast<int64_t>(ref.records.front().moe.size()), moe_layers);
  if (world_->size() != 2) return;
  DeviceMesh dp(*world_, 1, 1), pp(*world_, 1, 2), ep(*world_, 1, 1, 2);
  expect_close(testing::run_trainer(from_hf("dp2", {}), &dp), ref, family + " dp 2");
  expect_close(testing::run_trainer(from_hf("zero3", {{"parallel.zero", "3"}}), &dp), ref,
               family + " dp 2 ZeRO-3");
  expect_close(testing::run_trainer(from_hf("ep2", {{"parallel.ep", "2"}, {"parallel.zero", "1"}}),
                                    &ep),
               ref, family + " ep 2 ZeRO-1");
  expect_close(testing::run_trainer(from_hf("pp2", {{"parallel.pp", "2"}}), &pp), ref,
               family + " pp 2");
  if (c.qk_norm == QkNorm::full) return;  // OLMoE's QK-norm spans the heads: tp 1 only
  DeviceMesh tp(*world_, 2, 1);
  expect_close(testing::run_trainer(from_hf("tp2", {{"parallel.tp", "2"}}), &tp), ref,
               family + " tp 2");
}

INSTANTIATE_TEST_SUITE_P(Hf, MoeFamilies,
                         ::testing::Values("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"));

// moe.aux_scope = "step": the load-balancing statistic over every micro-batch
// of the step and every dp rank (a routing pass first). One rank's 4
// micro-batches equal one micro-batch of all 8 rows (where both scopes
// agree), while counting per micro-batch does not; dp 2, ep 2 and pp 2 (each
// rank 2 micro-batches of the step) equal the one-rank run.
TEST_F(MoeTrainer, StepScopeBalancingCountsTheWholeStep) {
  auto step = [](ConfigOverrides extra) {
    ConfigOverrides o = {{"moe.aux_scope", "step"},
                         {"moe.aux_loss", "0.5"},
                         {"moe.capacity_factor", "0"},  // a capacity per micro-batch would differ
                         {"train.eval_interval", "0"}};
    o.insert(o.end(), extra.begin(), extra.end());
    return o;
  };
  const testing::TrainerRun whole = reference("step_whole", step({{"train.micro_batch_size", "8"}}));
  const testing::TrainerRun split = reference("step_split", step({}));
  expect_close(split, whole, "aux_scope step: 4 micro-batches against 1 of 8 rows");
  testing::expect_memory_matches(split.predicted, split.memory, "MoE step scope (routing pass)");
  const testing::TrainerRun micro =
      reference("step_micro", step({{"moe.aux_scope", "micro_batch"}}));
  double differs = 0;
  for (size_t i = 0; i < whole.records.size(); ++i) {
    differs = std::max(differs, std::fabs(micro.records[i].grad_norm - whole.records[i].grad_norm) /
                                    whole.records[i].grad_norm);
  }
  EXPECT_GT(differs, 1e-3) << "per micro-batch counting should move the gradients";
  if (world_->size() != 2) return;
  DeviceMesh dp(*world_, 1, 1), pp(*world_, 1, 2), ep(*world_, 1, 1, 2);
  expect_close(testing::run_trainer(config("step_dp2", step({})), &dp), split, "step scope dp 2");
  expect_close(testing::run_trainer(config("step_ep2", step({{"parallel.ep", "2"}})), &ep), split,
               "step scope ep 2");
  expect_close(testing::run_trainer(config("step_pp2", step({{"parallel.pp", "2"}})), &pp), split,
               "step scope pp 2");
}

TEST_F(MoeTrainer, PipelineEqualsOneRank) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  const testing::TrainerRun ref = reference("ref");
  DeviceMesh mesh(*world_, 1, 2);
  const testing::TrainerRun got =
      testing::run_trainer(config("pp2", {{"parallel.pp", "2"}}), &mesh);
  expect_close(got, ref, "pp 2 1F1B");
  testing::expect_memory_matches(got.predicted, got.memory, "MoE pp 2 1F1B");
}

TEST_F(MoeTrainer, RecomputeEqualsKeepingEverything) {
  const testing::TrainerRun ref = reference("ref");
  const testing::TrainerRun got = reference("full", {{"train.recompute", "full"}});
  testing::expect_memory_matches(ref.predicted, ref.memory, "MoE one rank");
  const testing::TrainerRun ungated = reference(
      "ungated",
      {{"moe.shared_gate", "false"}, {"moe.capacity_factor", "0"}, {"train.precision", "bf16"}});
  testing::expect_memory_matches(ungated.predicted, ungated.memory,
                                 "MoE one rank, ungated, dropless, bf16");
  testing::expect_memory_matches(got.predicted, got.memory, "MoE one rank, recompute full");
  ASSERT_EQ(got.records.size(), ref.records.size());
  for (size_t i = 0; i < ref.records.size(); ++i) {
    EXPECT_EQ(got.records[i].loss, ref.records[i].loss) << "step " << i + 1;
  }
  EXPECT_EQ(0, std::memcmp(got.weights.data(), ref.weights.data(), ref.weights.size() * 4));
}

// A checkpoint written at dp 2 with ZeRO-1 (each rank writes its shard of
// the expert tensors' state) resumes on one rank, and one rank's resumes at
// dp 2: both continue the uninterrupted one-rank trace.
TEST_F(MoeTrainer, CheckpointsReshardBetweenOneRankAndDp2) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  const ConfigOverrides ckpt{{"train.checkpoint_interval", "8"}};
  const testing::TrainerRun ref = reference("reshard_ref", ckpt);
  DeviceMesh mesh(*world_, 1, 1);
  ConfigOverrides zero1 = ckpt;
  zero1.emplace_back("parallel.zero", "1");
  testing::run_trainer(config("reshard_dp2", zero1), &mesh);
  world_->barrier();
  // dp 2 -> one rank (every rank alone), and one rank (rank 0's reference) -> dp 2.
  const testing::TrainerRun one = testing::run_trainer(
      config(fmt::format("reshard_one.rank{}", world_->rank())), nullptr,
      dir_ + "/reshard_dp2/step_8", false, true);
  const testing::TrainerRun two = testing::run_trainer(
      config("reshard_two", {{"parallel.zero", "1"}}), &mesh,
      dir_ + "/reshard_ref.rank0/step_8", false, true);
  for (const testing::TrainerRun* run : {&one, &two}) {
    ASSERT_EQ(run->records.size(), 8u);
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_NEAR(run->records[i].loss, ref.records[8 + i].loss,
                  1e-5 * std::fabs(ref.records[8 + i].loss))
          << (run == &one ? "dp 2 -> 1" : "1 -> dp 2") << " step " << run->records[i].step;
    }
  }
}

TEST_F(MoeTrainer, ResumeContinuesBitForBit) {
  const std::string name = fmt::format("resume.rank{}", world_->rank());
  const testing::TrainerRun full =
      testing::run_trainer(config(name, {{"train.checkpoint_interval", "8"}}));
  const testing::TrainerRun rest = testing::run_trainer(
      config(name + "_rest"), nullptr, dir_ + "/" + name + "/step_8");
  ASSERT_EQ(rest.records.size(), 8u);
  for (size_t i = 0; i < rest.records.size(); ++i) {
    EXPECT_EQ(rest.records[i].loss, full.records[8 + i].loss) << "step " << rest.records[i].step;
  }
  EXPECT_EQ(0, std::memcmp(rest.weights.data(), full.weights.data(), full.weights.size() * 4));
}

// Expert parallelism: the experts split over ep of the dp ranks, tokens
// exchanged by all-to-alls, expert gradients averaged over the
// expert-data-parallel group. Every ep dividing the world equals one rank,
// with recompute and with ZeRO 1 and 3.
TEST_F(MoeTrainer, ExpertParallelEqualsOneRank) {
  if (world_->size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const testing::TrainerRun ref = reference("ep_ref");
  for (int ep = 2; ep <= world_->size(); ep *= 2) {
    DeviceMesh mesh(*world_, 1, 1, ep);
    const std::string n = std::to_string(ep);
    const uint64_t before = mesh.ep().stats()[CommOp::all_to_all].calls;
    const testing::TrainerRun plain = testing::run_trainer(config("ep" + n, {{"parallel.ep", n}}), &mesh);
    expect_close(plain, ref, fmt::format("ep {} (dp {})", ep, world_->size()));
    // The experts' state exactly; the expert-side rows at the balanced load.
    testing::expect_memory_matches(plain.predicted, plain.memory, "MoE ep " + n);
    // The all-to-alls reach metrics.jsonl and the report's communication section.
    EXPECT_GT(plain.records.back().ep_comm_bytes, 0u);
    world_->barrier();
    if (world_->rank() == 0) {
      const nlohmann::json summary = report::summarize_run(dir_ + "/ep" + n);
      EXPECT_GT(summary["comm"][0]["all_to_all_ms"].get<double>(), 0.0);
      EXPECT_NE(report::render_html(summary).find("<th>all-to-all ms</th>"), std::string::npos);
    }
    expect_close(testing::run_trainer(config("ep" + n + "_full", {{"parallel.ep", n},
                                                                   {"train.recompute", "full"}}),
                                      &mesh),
                 ref, fmt::format("ep {} (dp {}), recompute full", ep, world_->size()));
    // ZeRO shards the experts' state over their expert-data-parallel group.
    for (const char* zero : {"1", "3"}) {
      const testing::TrainerRun run = testing::run_trainer(
          config(fmt::format("ep{}_z{}", n, zero), {{"parallel.ep", n}, {"parallel.zero", zero}}),
          &mesh);
      expect_close(run, ref, fmt::format("ep {} (dp {}) ZeRO-{}", ep, world_->size(), zero));
      // ZeRO-1's state exactly; ZeRO-3's gathered units within their bound.
      testing::expect_memory_matches(run.predicted, run.memory,
                                     fmt::format("MoE ep {} ZeRO-{}", n, zero));
    }
    // Dropless in bf16, and DeepSeek-V3's bias balancing (the loads summed
    // over the dp ranks, the bias moved the same on every rank); ZeRO-2, and
    // ZeRO-3 with the state (the experts' flats too) offloaded to host copies.
    if (ep == 2) {
      expect_close(testing::run_trainer(config("ep2_z2", {{"parallel.ep", n},
                                                          {"parallel.zero", "2"}}),
                                        &mesh),
                   ref, "ep 2 ZeRO-2");
      expect_close(testing::run_trainer(config("ep2_z3_cpu", {{"parallel.ep", n},
                                                              {"parallel.zero", "3"},
                                                              {"parallel.offload", "cpu"}}),
                                        &mesh),
                   ref, "ep 2 ZeRO-3, offload cpu");
      const ConfigOverrides bf16{{"moe.capacity_factor", "0"}, {"train.precision", "bf16"}};
      ConfigOverrides at_ep = bf16;
      at_ep.emplace_back("parallel.ep", n);
      expect_close(testing::run_trainer(config("ep2_bf16", at_ep), &mesh),
                   reference("ep_ref_bf16", bf16), "ep 2 dropless bf16",
                   Tolerance{2e-3, 2e-2, 1e-2f});
      const ConfigOverrides biased{{"moe.bias_update_rate", "0.01"}, {"moe.aux_loss", "0"}};
      at_ep = biased;
      at_ep.emplace_back("parallel.ep", n);
      expect_close(testing::run_trainer(config("ep2_bias", at_ep), &mesh),
                   reference("ep_ref_bias", biased), "ep 2 bias balancing");
    }
    // Per MoE layer and micro-batch: counts, then rows forward, both ways
    // backward (and again under recompute); more than one per step anyway.
    EXPECT_GT(mesh.ep().stats()[CommOp::all_to_all].calls - before, 4u * 32u * 3u);
  }
}

// Tensor parallelism: attention and the shared experts split over tp as
// dense blocks are, the router and routed experts whole on every tp rank;
// with and without sequence parallelism, and folded with ep on 4 ranks.
TEST_F(MoeTrainer, TensorParallelEqualsOneRank) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  const testing::TrainerRun ref = reference("tp_ref");
  DeviceMesh mesh(*world_, 2, 1);
  const testing::TrainerRun tp2 = testing::run_trainer(config("tp2", {{"parallel.tp", "2"}}), &mesh);
  expect_close(tp2, ref, "tp 2");
  testing::expect_memory_matches(tp2.predicted, tp2.memory, "MoE tp 2");
  const testing::TrainerRun sp = testing::run_trainer(
      config("tp2_sp", {{"parallel.tp", "2"}, {"parallel.sequence_parallel", "true"}}), &mesh);
  expect_close(sp, ref, "tp 2 + SP");
  testing::expect_memory_matches(sp.predicted, sp.memory, "MoE tp 2 + SP");
  expect_close(testing::run_trainer(config("tp2_bf16", {{"parallel.tp", "2"},
                                                        {"train.precision", "bf16"},
                                                        {"train.recompute", "full"}}),
                                    &mesh),
               reference("tp_ref_bf16", {{"train.precision", "bf16"}, {"train.recompute", "full"}}),
               "tp 2 bf16, recompute full", Tolerance{2e-3, 2e-2, 1e-2f});
}

TEST_F(MoeTrainer, ExpertParallelWithTensorParallelEqualsOneRank) {
  if (world_->size() != 4 && world_->size() != 8) {
    GTEST_SKIP() << "needs 4 or 8 ranks (tp 2 x dp 2 or 4)";
  }
  const testing::TrainerRun ref = reference("ep_tp_ref");
  if (world_->size() == 8) {  // ep 4 x tp 2 (dp 4)
    DeviceMesh mesh(*world_, 2, 1, 4);
    expect_close(testing::run_trainer(config("ep4_tp2", {{"parallel.ep", "4"}, {"parallel.tp", "2"},
                                                         {"parallel.sequence_parallel", "true"}}),
                                      &mesh),
                 ref, "ep 4 x tp 2 + SP (dp 4)");
    return;
  }
  DeviceMesh mesh(*world_, 2, 1, 2);
  for (const char* zero : {"0", "1"}) {
    expect_close(testing::run_trainer(config(fmt::format("ep2_tp2_z{}", zero),
                                             {{"parallel.ep", "2"}, {"parallel.tp", "2"},
                                              {"parallel.sequence_parallel", "true"},
                                              {"parallel.zero", zero}}),
                                      &mesh),
                 ref, fmt::format("ep 2 x tp 2 + SP (dp 2) ZeRO-{}", zero));
  }
}

TEST_F(MoeTrainer, ExpertParallelWithPipelineEqualsOneRank) {
  if (world_->size() != 4) GTEST_SKIP() << "needs 4 ranks (pp 2 x dp 2)";
  const testing::TrainerRun ref = reference("ep_pp_ref");
  DeviceMesh mesh(*world_, 1, 2, 2);
  expect_close(testing::run_trainer(config("ep2_pp2", {{"parallel.ep", "2"}, {"parallel.pp", "2"}}),
                                    &mesh),
               ref, "ep 2 x pp 2 (dp 2) 1F1B");
}

// A checkpoint written at ep 2 (each expert region written once, by its
// expert-data-parallel group) resumes bit for bit at ep 2, and at ep 1 (dp
// 2), on one process and at ep 4 with ZeRO-3 it continues the one-rank trace.
TEST_F(MoeTrainer, ExpertParallelCheckpointsResumeAtAnyEp) {
  if (world_->size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const ConfigOverrides ckpt{{"train.checkpoint_interval", "8"}};
  const testing::TrainerRun ref = reference("ep_ckpt_ref", ckpt);
  DeviceMesh ep2(*world_, 1, 1, 2), ep1(*world_, 1, 1);
  ConfigOverrides at_ep2 = ckpt;
  at_ep2.emplace_back("parallel.ep", "2");
  const testing::TrainerRun full = testing::run_trainer(config("ep_ckpt", at_ep2), &ep2);
  const std::string step8 = dir_ + "/ep_ckpt/step_8";
  const testing::TrainerRun same =
      testing::run_trainer(config("ep_ckpt_same", {{"parallel.ep", "2"}}), &ep2, step8);
  ASSERT_EQ(same.records.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(same.records[i].loss, full.records[8 + i].loss) << "ep 2 -> 2 step " << i + 9;
  }
  EXPECT_EQ(0, std::memcmp(same.weights.data(), full.weights.data(), full.weights.size() * 4));
  std::vector<std::pair<std::string, testing::TrainerRun>> resumed;
  resumed.emplace_back("ep 2 -> ep 1 (dp 2)",
                       testing::run_trainer(config("ep_ckpt_ep1"), &ep1, step8, false, true));
  resumed.emplace_back("ep 2 -> one process",
                       testing::run_trainer(config(fmt::format("ep_ckpt_one.rank{}",
                                                               world_->rank())),
                                            nullptr, step8, false, true));
  if (world_->size() == 4) {
    DeviceMesh ep4(*world_, 1, 1, 4);
    resumed.emplace_back("ep 2 -> ep 4 ZeRO-3",
                         testing::run_trainer(config("ep_ckpt_ep4", {{"parallel.ep", "4"},
                                                                     {"parallel.zero", "3"}}),
                                              &ep4, step8, false, true));
  }
  for (const auto& [what, run] : resumed) {
    ASSERT_EQ(run.records.size(), 8u) << what;
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_NEAR(run.records[i].loss, ref.records[8 + i].loss,
                  1e-5 * std::fabs(ref.records[8 + i].loss))
          << what << " step " << run.records[i].step;
    }
  }
}

}  // namespace
}  // namespace meshtrain
