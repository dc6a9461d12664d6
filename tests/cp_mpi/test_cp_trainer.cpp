// Context parallelism through whole Trainer runs under mpirun: each sequence
// cut over the cp ranks (parallel.cp, cp_comm = "allgather") equals one rank
// on the same global batch — loss trace, gradient norms and final weights —
// for Llama with grouped-query attention and GPT-2 (learned positions), in
// fp32 and bf16, with packed SFT rows, with selective and full recompute, and
// composed with dp, tp + sequence parallelism, pp and ZeRO-3. A checkpoint
// written at cp 2 resumes at cp 1 (and at cp 4) and continues the trace.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/plan/memory.h"
#include "meshtrain/train/memory_check.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/memory_expect.h"
#include "support/scratch.h"
#include "support/sft_run.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

// fp32: the attention's sums run in another order (the key blocks of the
// chunks, dK and dV summed over the cp ranks; the ring's blocks merged by
// log-sum-exp), so traces agree to rounding, not bit for bit. bf16: losses
// within bf16 rounding of the same; weights within 2e-2, as AdamW turns a
// near-zero gradient's rounding into a full step of either sign (the ring's
// bf16 probabilities are rounded per block: GPT-2's largest weight
// difference after 8 steps is 1.4e-2 there, 3e-3 with the all-gather).
using Tolerance = testing::RunTolerance;
constexpr Tolerance kBf16{2e-3, 2e-2, 2e-2f};

class ContextParallelTrainer : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::shared_phrase_corpus(*world_, 61); }

  TrainConfig config(const std::string& out, ConfigOverrides extra = {},
                     const std::string& family = "llama") const {
    const std::string model = family == "llama" ? R"(
[model]
family = "llama"
dim = 32
n_layers = 3
n_heads = 4
n_kv_heads = 2
hidden_dim = 48
vocab_size = 61
max_seq_len = 64
tie_embeddings = false
)"
                                                : R"(
[model]
family = "gpt2"
dim = 32
n_layers = 3
n_heads = 4
hidden_dim = 128
vocab_size = 61
max_seq_len = 64
)";
    return testing::tiny_run_config(model + R"(
[train]
steps = 8
batch_size = 4
micro_batch_size = 2
seq_len = 32
threads = 1
grad_clip = 1.0
eval_interval = 4
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
                                    dir_, out, std::move(extra), "cp.toml");
  }

  // The single-rank reference, every rank alone in its own directory.
  // A mixture of experts on the llama trunk: top-2 of 4 SwiGLU experts, a
  // gated shared expert, a dense first layer, the load-balancing and z
  // losses; dropless (a capacity is refused under cp).
  TrainConfig moe_config(const std::string& out, ConfigOverrides extra) const {
    extra.insert(extra.begin(), {{"moe.experts", "4"}, {"moe.top_k", "2"}, {"moe.hidden_dim", "24"},
                                 {"moe.shared_hidden", "16"}, {"moe.shared_gate", "true"},
                                 {"moe.first_dense", "1"}, {"moe.aux_loss", "0.01"},
                                 {"moe.z_loss", "0.001"}});
    return config(out, std::move(extra));
  }

  testing::TrainerRun reference(const TrainConfig& c) const {
    TrainConfig alone = c;
    alone.parallel = ParallelSettings{};
    alone.train.out_dir += fmt::format(".ref{}", world_->rank());
    return testing::run_trainer(alone, nullptr, "", true);
  }

  void expect_close(const testing::TrainerRun& got, const testing::TrainerRun& ref,
                    const std::string& what, Tolerance tol = Tolerance()) {
    testing::expect_runs_close(got, ref, what, tol, "cp", world_->rank() == 0);
  }

  // `c` on `mesh`, with each cp_comm (Ulysses where the tp x cp ranks split
  // the heads), against one rank; the memory as predicted.
  void check(const TrainConfig& c, DeviceMesh& mesh, const std::string& what,
             Tolerance tol = Tolerance()) {
    const testing::TrainerRun ref = reference(c);
    const int64_t split = static_cast<int64_t>(c.parallel.tp) * c.parallel.cp;
    const bool heads_split = c.model.n_heads % split == 0 && c.model.n_kv_heads % split == 0;
    for (const char* method : {"allgather", "ring", "alltoall"}) {
      if (std::string(method) == "alltoall" && !heads_split) continue;
      TrainConfig run = c;
      run.parallel.cp_comm = method;
      run.train.out_dir += std::string(".") + method;
      const testing::TrainerRun got = testing::run_trainer(run, &mesh, "", true);
      expect_close(got, ref, what + " " + method, tol);
      // Evaluation: the validation set's rows cut like training's.
      EXPECT_NEAR(got.val_loss, ref.val_loss, tol.loss * ref.val_loss) << what << " " << method;
      testing::expect_memory_matches(got.predicted, got.memory, what + " " + method);
    }
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(ContextParallelTrainer, TwoRanksEqualOneForLlamaAndGpt2) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  DeviceMesh mesh(*world_, 1, 1, 1, 2);
  check(config("cp2_llama", {{"parallel.cp", "2"}}), mesh, "llama GQA cp 2 fp32");
  check(config("cp2_gpt2", {{"parallel.cp", "2"}}, "gpt2"), mesh, "gpt2 cp 2 fp32");
  check(config("cp2_llama_bf16", {{"parallel.cp", "2"}, {"train.precision", "bf16"}}), mesh,
        "llama GQA cp 2 bf16", kBf16);
  check(config("cp2_gpt2_bf16", {{"parallel.cp", "2"}, {"train.precision", "bf16"}}, "gpt2"),
        mesh, "gpt2 cp 2 bf16", kBf16);
}

TEST_F(ContextParallelTrainer, TwoRanksEqualOneWithRecompute) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  DeviceMesh mesh(*world_, 1, 1, 1, 2);
  for (const char* mode : {"selective", "full"}) {
    check(config(fmt::format("cp2_rc_{}", mode),
                 {{"parallel.cp", "2"}, {"train.recompute", mode}}),
          mesh, fmt::format("cp 2 recompute {}", mode));
  }
}

// LoRA adapters (the frozen base's activations cut like any other) and fp16
// with dynamic loss scaling (the gates' decision is one collective over the
// world, so every cp rank skips or applies the same steps).
TEST_F(ContextParallelTrainer, ComposesWithLoraAndFp16) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  DeviceMesh mesh(*world_, 1, 1, 1, 2);
  check(config("cp2_lora", {{"parallel.cp", "2"}, {"lora.rank", "4"}}), mesh, "LoRA cp 2");
  check(config("cp2_fp16", {{"parallel.cp", "2"}, {"train.precision", "fp16"}}), mesh,
        "fp16 cp 2", kBf16);
}

// MoE layers are token-local; the per-micro-batch balancing statistic counts
// the whole micro-batch's choices (summed over the cp group), the step scope
// the step's over every replica.
TEST_F(ContextParallelTrainer, MixtureOfExpertsEqualsOneRank) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  DeviceMesh mesh(*world_, 1, 1, 1, 2);
  check(moe_config("cp2_moe", {{"parallel.cp", "2"}}), mesh, "MoE cp 2");
  check(moe_config("cp2_moe_step", {{"parallel.cp", "2"}, {"moe.aux_scope", "step"}}), mesh,
        "MoE cp 2, step-scope balancing");
}

// Packed SFT rows: records run across the chunk boundaries, each token's
// record-local position and record mask kept.
TEST_F(ContextParallelTrainer, PackedSftRowsEqualOneRank) {
  if (world_->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  DeviceMesh mesh(*world_, 1, 1, 1, 2);
  const std::string out = dir_ + "/cp2_sft";
  const TrainConfig c = testing::sft_run_config(out, {{"parallel.cp", "2"}, {"train.threads", "1"}});
  check(c, mesh, "packed SFT cp 2");
}

TEST_F(ContextParallelTrainer, ComposesWithDataTensorPipelineAndZero) {
  if (world_->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  {
    DeviceMesh mesh(*world_, 1, 1, 1, 4);
    check(config("cp4", {{"parallel.cp", "4"}}), mesh, "cp 4");
    check(config("cp4_gpt2", {{"parallel.cp", "4"}}, "gpt2"), mesh, "gpt2 cp 4");
    check(config("cp4_bf16", {{"parallel.cp", "4"}, {"train.precision", "bf16"}}), mesh,
          "cp 4 bf16", kBf16);
  }
  {
    DeviceMesh mesh(*world_, 1, 1, 1, 2);
    check(config("dp2_cp2", {{"parallel.cp", "2"}}), mesh, "dp 2 x cp 2");
    check(config("dp2_cp2_z3", {{"parallel.cp", "2"}, {"parallel.zero", "3"}}), mesh,
          "dp 2 x cp 2 ZeRO-3");
  }
  {
    DeviceMesh mesh(*world_, 2, 1, 1, 2);
    check(config("cp2_tp2_sp", {{"parallel.cp", "2"},
                                {"parallel.tp", "2"},
                                {"parallel.sequence_parallel", "true"}}),
          mesh, "cp 2 x tp 2 + SP");
  }
  {
    DeviceMesh mesh(*world_, 1, 2, 1, 2);
    check(config("cp2_pp2", {{"parallel.cp", "2"}, {"parallel.pp", "2"}}), mesh, "cp 2 x pp 2");
  }
  {
    // Interleaved 1F1B: two chunks of two layers per stage. The 4-layer
    // model's weights land within 2.5e-5 of one rank's under cp 2 with or
    // without pipelines (dp 2 x cp 2 too): AdamW's step on an element whose
    // gradient is rounding noise; its loss and gradient norms are as tight.
    DeviceMesh mesh(*world_, 1, 2, 1, 2);
    check(config("cp2_pp2_interleaved", {{"parallel.cp", "2"}, {"parallel.pp", "2"},
                                         {"parallel.schedule", "interleaved"},
                                         {"parallel.virtual_stages", "2"}, {"model.n_layers", "4"}}),
          mesh, "cp 2 x pp 2 interleaved", Tolerance{1e-5, 1e-4, 5e-5f});
  }
  {
    // Expert parallelism over the dp x cp replicas.
    DeviceMesh mesh(*world_, 1, 1, 2, 2);
    check(moe_config("cp2_ep2", {{"parallel.cp", "2"}, {"parallel.ep", "2"}}), mesh,
          "MoE dp 2 x cp 2, ep 2");
  }
}

// Long context that does not fit one rank: a 2048-token sequence whose
// attention activations exceed a rank's memory limit at cp 1 (the check
// before allocating refuses it and names parallel.cp = 4 as a lever that
// fits) trains at cp 4 on four ranks, each within the limit, its memory as
// predicted. The limit is applied per rank, as a GPU's memory would be (the
// host check sums the ranks of a host against its cgroup).
TEST_F(ContextParallelTrainer, LongSequenceThatDoesNotFitOneRankTrainsAtCp4) {
  if (world_->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const ConfigOverrides long_seq{{"train.seq_len", "2048"}, {"model.max_seq_len", "2048"},
                                 {"train.batch_size", "1"}, {"train.micro_batch_size", "1"},
                                 {"train.steps", "2"}, {"train.eval_interval", "0"}};
  TrainConfig one = config("long_cp1", long_seq);
  ConfigOverrides at_cp4 = long_seq;
  at_cp4.push_back({"parallel.cp", "4"});
  TrainConfig four = config("long_cp4", at_cp4);
  one.data.val.clear();  // the corpus's validation file is shorter than one sequence
  four.data.val.clear();
  const double need_one = predict_run_memory(one, 1).front().host_bytes;
  double need_four = 0;
  for (const RankMemory& r : predict_run_memory(four, 4)) need_four = std::max(need_four, r.host_bytes);
  ASSERT_LT(2 * need_four, need_one) << "the sequence should dominate a rank's memory";
  const double limit = (need_one + need_four) / 2;
  const std::optional<std::string> why =
      memory_refusal(one, predict_run_memory(one, 1), {0}, {{limit, "one rank's memory (test)"}});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("parallel.cp = 4 on 4 ranks would need " +
                      format_bytes(static_cast<size_t>(need_four)) + " per rank"),
            std::string::npos)
      << *why;
  EXPECT_NE(why->find("(fits)"), std::string::npos) << *why;
  DeviceMesh mesh(*world_, 1, 1, 1, 4);
  const testing::TrainerRun got = testing::run_trainer(four, &mesh);
  ASSERT_EQ(got.records.size(), 2u);
  EXPECT_TRUE(std::isfinite(got.records.back().loss));
  EXPECT_LE(static_cast<double>(got.memory.peak_total), limit);
  testing::expect_memory_matches(got.predicted, got.memory, "2048 tokens at cp 4");
  if (world_->rank() == 0) {
    fmt::print("[cp] 2048 tokens: cp 1 needs {} on one rank, cp 4 {} per rank (measured {})\n",
               format_bytes(static_cast<size_t>(need_one)),
               format_bytes(static_cast<size_t>(need_four)), format_bytes(got.memory.peak_total));
  }
}

// The planner's closed form of the engine (plan::engine_memory) with its
// context-parallel terms against what a cp rank's tracker holds after one
// forward/backward: params, grads, optimizer, activations and the exchange
// buffers exactly, for every method (Ulysses where the heads divide) and
// with recompute.
TEST_F(ContextParallelTrainer, PlannerEngineMemoryMatchesACpRank) {
  const int cp = world_->size();
  if (cp < 2) GTEST_SKIP() << "needs 2 or more ranks";
  ModelConfig c = model_preset("llama-tiny");
  c.max_seq_len = 64;
  const int64_t batch = 2, seq = 16 * cp;
  const std::pair<CpComm, const char*> methods[] = {
      {CpComm::allgather, "allgather"}, {CpComm::ring, "ring"}, {CpComm::alltoall, "alltoall"}};
  for (const auto& [method, name] : methods) {
    if (method == CpComm::alltoall && (c.n_heads % cp != 0 || c.n_kv_heads % cp != 0)) continue;
    for (Recompute mode : {Recompute::none, Recompute::selective, Recompute::full}) {
      SCOPED_TRACE(fmt::format("{} recompute {}", name, recompute_name(mode)));
      MemoryTracker tracker;
      cpu::CpuBackend backend(1, tracker);
      Model model(c, Precision::bf16, backend);
      model.set_recompute({mode, 0});
      model.set_context_parallel(ContextParallel{world_.get(), method});
      model.init_weights(7);
      AdamW adamw(model, AdamWConfig{});
      const ContextSplit split{world_->rank(), cp};
      const int64_t local = split.local(seq);
      std::vector<int32_t> tokens(static_cast<size_t>(batch * local)), positions(tokens.size());
      for (size_t i = 0; i < tokens.size(); ++i) {
        tokens[i] = static_cast<int32_t>((i * 7 + 3) % static_cast<size_t>(c.vocab_size));
        positions[i] = static_cast<int32_t>(split.global(seq, static_cast<int64_t>(i) % local));
      }
      model.zero_grads();
      model.forward_backward(tokens.data(), tokens.data(), batch, local, 1.0f, positions.data());
      const plan::MemoryBreakdown want =
          plan::engine_memory(c, Precision::bf16, batch, seq, {mode, 0}, cp, method);
      EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::params)), want.params);
      EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::grads)), want.grads);
      EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::optimizer)), want.optimizer);
      EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::activations)), want.activations);
      EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::comm)), want.comm);
    }
  }
}

// A checkpoint written at cp 2 resumes bit for bit at cp 2, and at another
// cp (np 2: cp 1, each rank alone; np 4: cp 4 from dp 2 x cp 2) it continues
// the trace: cp changes the layout of nothing saved, the data position is
// the global batch's.
TEST_F(ContextParallelTrainer, ResumeAcrossACpChangeContinuesTheTrace) {
  const int n = world_->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  DeviceMesh mesh(*world_, 1, 1, 1, 2);
  const testing::TrainerRun whole = testing::run_trainer(
      config("resume_whole", {{"parallel.cp", "2"}, {"train.checkpoint_interval", "4"}}), &mesh);
  const std::string ckpt = dir_ + "/resume_whole/step_4";
  ASSERT_TRUE(std::filesystem::exists(ckpt)) << ckpt;
  auto expect_continues = [&](const testing::TrainerRun& rest, bool exact, const std::string& what) {
    ASSERT_EQ(rest.records.size(), 4u) << what;
    for (size_t i = 0; i < rest.records.size(); ++i) {
      const StepRecord& want = whole.records[i + 4];
      EXPECT_EQ(rest.records[i].step, want.step) << what;
      if (exact) {
        EXPECT_EQ(rest.records[i].loss, want.loss) << what << ": step " << want.step;
      } else {
        EXPECT_NEAR(rest.records[i].loss, want.loss, 1e-5 * want.loss) << what << ": step " << want.step;
      }
    }
  };
  expect_continues(
      testing::run_trainer(
          config("resume_same", {{"parallel.cp", "2"}, {"train.checkpoint_interval", "4"}}), &mesh,
          ckpt),
      true, "resumed at cp 2");
  if (n == 2) {
    // Every rank resumes alone (cp 1) in a directory of its own.
    expect_continues(testing::run_trainer(config(fmt::format("resume_rest{}", world_->rank())),
                                          nullptr, ckpt, false, true),
                     false, "resumed at cp 1");
  } else {
    DeviceMesh cp4(*world_, 1, 1, 1, 4);
    expect_continues(testing::run_trainer(config("resume_cp4", {{"parallel.cp", "4"}}), &cp4, ckpt,
                                          false, true),
                     false, "resumed at cp 4");
  }
}

}  // namespace
}  // namespace meshtrain
