// The per-rank memory prediction (train/memory_plan.h) against the engine:
// one rank equals plan::engine_memory (exact to the byte) and a Trainer's
// tracker; the refusal before allocating (a 7B model, a cgroup limit read
// from a fake root, the offload budget); the multi-rank layouts are checked
// against their trainers in tests/pipeline_mpi/test_recompute_trainer.cpp.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshtrain/data/token_file.h"
#include "meshtrain/model/config.h"
#include "meshtrain/tensor/nf4.h"
#include "meshtrain/plan/finetune.h"
#include "meshtrain/plan/memory.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/train/memory_check.h"
#include "meshtrain/train/memory_plan.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"
#include "support/memory_expect.h"
#include "support/scratch.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

class MemoryPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::scratch_dir();
    testing::write_phrase_corpus(dir_, 64);
  }
  // Trains `c` and expects the tracker's peaks to be its rank-0 memory plan.
  static void expect_run_matches_plan(const TrainConfig& c, const std::string& name) {
    SCOPED_TRACE(name);
    TrainerOptions options;
    options.console = false;
    Trainer trainer(c, options);
    trainer.run();
    testing::expect_memory_matches(trainer.memory_plan().at(0), trainer.tracker().snapshot(), name);
  }

  TrainConfig config(const std::string& family, ConfigOverrides extra = {}) const {
    return testing::memory_plan_config(dir_, family, std::move(extra));
  }
  std::string dir_;
};

RankMemory one_rank(const TrainConfig& c) { return predict_run_memory(c, 1).at(0); }

// The one-rank prediction is the single-rank engine model of plan/memory.cpp,
// reached through the layout code (param specs, stage selection, schedule).
// Qwen3's attention (QK-norm per head, a head width that is not dim / n_heads)
// with Qwen2's q/k/v biases, and OLMoE's QK-norm over the whole projection.
const ConfigOverrides kQwenAttention = {
    {"model.qk_norm", "head"}, {"model.head_dim", "12"}, {"model.qkv_bias", "true"}};
const ConfigOverrides kOlmoeAttention = {{"model.qk_norm", "full"}};

TEST_F(MemoryPlanTest, OneRankEqualsTheEngineModel) {
  for (const char* family : {"llama", "gpt2", "qwen", "olmoe"}) {
    const bool qwen = std::string(family) == "qwen", olmoe = std::string(family) == "olmoe";
    for (const char* mode : {"none", "selective", "full"}) {
      for (const char* layers : {"0", "2"}) {
        if (std::string(layers) != "0" && std::string(mode) != "full") continue;
        ConfigOverrides extra = qwen ? kQwenAttention : olmoe ? kOlmoeAttention : ConfigOverrides{};
        extra.push_back({"train.recompute", mode});
        extra.push_back({"train.recompute_layers", layers});
        const TrainConfig c = config(qwen || olmoe ? "llama" : family, extra);
        SCOPED_TRACE(fmt::format("{} recompute {} layers {}", family, mode, layers));
        const plan::MemoryBreakdown want = plan::engine_memory(
            c.model, c.train.precision, c.train.micro_batch_size, c.train.seq_len,
            {c.train.recompute, c.train.recompute_layers});
        const RankMemory got = one_rank(c);
        EXPECT_EQ(got.at(MemCategory::params), want.params);
        EXPECT_EQ(got.at(MemCategory::grads), want.grads);
        EXPECT_EQ(got.at(MemCategory::optimizer), want.optimizer);
        EXPECT_EQ(got.at(MemCategory::activations), want.activations);
        EXPECT_EQ(got.at(MemCategory::comm), 0);
      }
    }
  }
}

// A whole run's tracker peaks per category against the prediction, for every
// recompute mode and both families (Llama in bf16, GPT-2 in fp32, both in fp16
// on 2 threads: oneDNN sizes its scratchpad by the thread count, fp16 GEMMs
// stage their operands; and with the start-up FLOP/s probe, whose GEMMs and
// operands are workspace too); the run's metrics carry both.
TEST_F(MemoryPlanTest, TrainerPeaksMatchThePrediction) {
  struct Run {
    const char* family;
    const char* precision;  // "" = the family's default
    const char* threads;
    bool probe = false;  // train.peak_flops = 0 (one recompute mode)
    const ConfigOverrides* attention = nullptr;  // today's attention options
  };
  for (const Run& run : {Run{"llama", "", "1"}, Run{"gpt2", "", "1"}, Run{"llama", "fp16", "2"},
                         Run{"gpt2", "fp16", "2"}, Run{"llama", "", "1", true},
                         Run{"llama", "", "1", false, &kQwenAttention},
                         Run{"llama", "fp32", "1", false, &kOlmoeAttention}}) {
    const char* family = run.family;
    for (const char* mode : {"none", "selective", "full"}) {
      if (run.probe && std::string(mode) != "none") continue;
      const std::string out =
          fmt::format("{}_{}{}{}{}_{}", family, run.precision, run.threads,
                      run.probe ? "_probe" : "", run.attention ? "_attention" : "", mode);
      ConfigOverrides extra = {{"train.recompute", mode},
                               {"train.out_dir", dir_ + "/" + out},
                               {"train.threads", run.threads}};
      if (run.attention != nullptr) extra.insert(extra.end(), run.attention->begin(), run.attention->end());
      if (*run.precision != 0) extra.push_back({"train.precision", run.precision});
      if (run.probe) extra.push_back({"train.peak_flops", "0"});
      const TrainConfig c = config(family, extra);
      SCOPED_TRACE(out);
      TrainerOptions options;
      options.console = false;
      Trainer trainer(c, options);
      trainer.run();
      testing::expect_memory_matches(trainer.memory_plan().at(0), trainer.tracker().snapshot(), out);
      // The end record: measured and predicted per category.
      std::ifstream in(fs::path(c.train.out_dir) / "metrics.jsonl");
      std::string line, last;
      while (std::getline(in, line)) {
        if (line.find("\"memory\":\"end\"") != std::string::npos) last = line;
      }
      ASSERT_FALSE(last.empty());
      const nlohmann::json j = nlohmann::json::parse(last);
      EXPECT_EQ(j["predicted"]["activations"].get<double>(),
                trainer.memory_plan()[0].at(MemCategory::activations));
      EXPECT_EQ(j["bytes"]["activations_peak"].get<double>(),
                trainer.memory_plan()[0].at(MemCategory::activations));
      EXPECT_EQ(j["basis"]["workspace"], "exact");
    }
  }
}

// QLoRA (lora.quantize_base = nf4): the packed base in params, its
// dequantisation workspace, in bf16 and fp32, with and without recompute;
// and the packed bytes per base parameter are the planner's NF4 figure.
TEST_F(MemoryPlanTest, QloraPeaksMatchThePredictionAndThePlannersBytes) {
  for (const char* precision : {"bf16", "fp32"}) {
    for (const char* mode : {"none", "full"}) {
      const std::string out = fmt::format("qlora_{}_{}", precision, mode);
      expect_run_matches_plan(config("llama", {{"train.precision", precision},
                                               {"train.recompute", mode},
                                               {"train.out_dir", dir_ + "/" + out},
                                               {"lora.rank", "4"},
                                               {"lora.quantize_base", "nf4"}}),
                              out);
    }
  }
  // Whole-model sizes: 4 bits, a u8 code per 64 and an f32 scale per 256 of those (the
  // planner's 4.127 bits), plus one f32 offset per tensor.
  for (const int64_t n : {int64_t{4096} * 4096, int64_t{4096} * 11008, int64_t{5120} * 13824}) {
    const double bytes = static_cast<double>(nf4::layout(n).bytes);
    EXPECT_NEAR(bytes / static_cast<double>(n), plan::kNf4DoubleQuantBits / 8, 1e-6) << n;
    // A tp rank's slice (nf4::Form::slice): the planner's 4.5 bits exactly.
    const double slice = static_cast<double>(nf4::layout(n / 2, nf4::Form::slice).bytes);
    EXPECT_DOUBLE_EQ(slice / static_cast<double>(n / 2), plan::kNf4SliceBits / 8) << n;
  }
}

// DPO (data.format = "preference-jsonl"): the reference pass with the adapters
// off (LoRA) and a reference precomputed before the first step (full
// fine-tuning), the head's token weights and losses: every category to the byte.
TEST_F(MemoryPlanTest, PreferencePeaksMatchThePrediction) {
  const std::string data = dir_ + "/pairs.jsonl";
  {
    std::ofstream out(data);
    for (int i = 0; i < 8; ++i) {
      out << fmt::format(R"({{"prompt": "q{}", "chosen": "yes {}", "rejected": "no"}})", i, i)
          << "\n";
    }
  }
  for (const char* method : {"lora", "full"}) {
    for (const char* precision : {"bf16", "fp32"}) {
      const std::string out = fmt::format("dpo_{}_{}", method, precision);
      ConfigOverrides o{{"train.precision", precision}, {"train.out_dir", dir_ + "/" + out},
                        {"model.vocab_size", "300"},     {"model.max_seq_len", "64"},
                        {"train.seq_len", "64"},         {"data.format", "preference-jsonl"},
                        {"data.train", data},            {"data.val", data}};
      if (std::string(method) == "lora") o.push_back({"lora.rank", "4"});
      expect_run_matches_plan(config("llama", o), out);
    }
  }
}

// Units that fit the numbers: a small run is not 0.00 GiB, and every rank of
// a layout is listed with its categories.
TEST_F(MemoryPlanTest, TableUsesUnitsThatFitAndListsEveryRankClass) {
  const TrainConfig c = config("llama", {{"parallel.tp", "2"}, {"parallel.pp", "3"},
                                         {"parallel.sequence_parallel", "true"}});
  const std::vector<RankMemory> ranks = predict_run_memory(c, 12);
  const std::string table = format_run_memory("run.toml", c, ranks);
  EXPECT_EQ(table.find("0.00 GiB"), std::string::npos) << table;
  EXPECT_NE(table.find("KiB"), std::string::npos) << table;
  // dp ranks are alike: tp x pp classes, each row naming its ranks.
  EXPECT_EQ(distinct_ranks(ranks).size(), 6u) << table;
  EXPECT_NE(table.find("pp stage 2 (layers 2, head), tp 1 of 2"), std::string::npos) << table;
  const nlohmann::json j = nlohmann::json::parse(run_memory_json("run.toml", c, ranks));
  ASSERT_EQ(j["ranks"].size(), 12u);
  EXPECT_EQ(j["ranks"][11]["bytes"]["params"].get<double>(), ranks[11].at(MemCategory::params));
}

// A config far too large refuses at start, in well under a second, naming
// the categories and the levers with what each would need.
TEST_F(MemoryPlanTest, SevenBillionParametersRefuseBeforeAllocating) {
  TrainConfig c = config("llama");
  c.model = plan::plan_model("llama2-7b").config;
  c.train.seq_len = 16;
  const auto start = std::chrono::steady_clock::now();
  TrainerOptions options;
  options.console = false;
  try {
    Trainer trainer(c, options);
    FAIL() << "a 7B model trained on this machine";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("memory check: rank 0 needs"), std::string::npos) << what;
    EXPECT_NE(what.find("optimizer"), std::string::npos) << what;
    EXPECT_NE(what.find("GiB"), std::string::npos) << what;
    EXPECT_NE(what.find("levers: train.recompute = \"full\" would need"), std::string::npos) << what;
    EXPECT_NE(what.find("parallel.offload = \"disk\""), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  // The escape hatch: "warn" goes on (and would allocate): checked by the prediction only.
  c.train.memory_check = "off";
  EXPECT_GT(one_rank(c).total(), 50e9);
}

// The limits come from the process's cgroup (v1 and v2, the tightest on its
// path) and MemAvailable; a refusal names the source.
TEST_F(MemoryPlanTest, ReadsCgroupLimitsAndRefusesNamingThem) {
  const fs::path root = fs::path(dir_) / "root";
  auto put = [&](const fs::path& rel, const std::string& text) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  put("proc/self/cgroup", "12:cpu,cpuacct:/a\n7:memory:/job/step\n0::/user.slice/job\n");
  put("sys/fs/cgroup/memory/job/memory.limit_in_bytes", "1048576\n");   // 1 MiB: tighter
  put("sys/fs/cgroup/memory/job/memory.usage_in_bytes", "524288\n");
  put("sys/fs/cgroup/memory/job/step/memory.limit_in_bytes", "9223372036854771712\n");  // none
  put("sys/fs/cgroup/unified/cgroup.controllers", "memory\n");
  put("sys/fs/cgroup/unified/user.slice/job/memory.max", "max\n");
  put("proc/meminfo", "MemTotal: 1000 kB\nMemAvailable:   256 kB\n");
  const std::vector<MemoryLimit> limits = host_memory_limits(root.string());
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[0].available, 524288);
  EXPECT_NE(limits[0].source.find("cgroup v1"), std::string::npos) << limits[0].source;
  EXPECT_NE(limits[0].source.find("job/memory.limit_in_bytes"), std::string::npos);
  EXPECT_EQ(limits[1].available, 256 * 1024);

  const TrainConfig c = config("llama");
  const std::vector<RankMemory> ranks = predict_run_memory(c, 1);
  const std::optional<std::string> why = memory_refusal(c, ranks, {0}, limits);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("cgroup v1"), std::string::npos) << *why;
  EXPECT_NE(why->find("MemAvailable"), std::string::npos) << *why;  // one cause each
  EXPECT_NE(why->find("activations"), std::string::npos) << *why;
  EXPECT_FALSE(memory_refusal(c, ranks, {0}, {{1e12, "big"}}).has_value());
}

// Each lever is the changed config predicted again; those that would fit say so.
TEST_F(MemoryPlanTest, LeversSayWhatEachWouldNeedAndWhichFit) {
  const TrainConfig c = config("gpt2", {{"train.micro_batch_size", "4"}});
  TrainConfig full = c;
  full.train.recompute = Recompute::full;
  const double need = one_rank(c).host_bytes, with_full = one_rank(full).host_bytes;
  ASSERT_LT(with_full, need);
  const std::vector<MemoryLimit> limit{{(need + with_full) / 2, "test limit"}};
  const std::optional<std::string> why = memory_refusal(c, predict_run_memory(c, 1), {0}, limit);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find(fmt::format("train.recompute = \"full\" would need {} (fits)",
                                  format_bytes(static_cast<size_t>(with_full)))),
            std::string::npos)
      << *why;
  EXPECT_NE(why->find("test limit"), std::string::npos) << *why;
}

// An offload budget below two pieces fails at start, naming the key and the
// minimum, whatever train.memory_check says (the store would fail at step 1).
TEST_F(MemoryPlanTest, OffloadBudgetBelowTwoPiecesIsRefused) {
  TrainConfig c = config("llama", {{"parallel.zero", "1"}, {"parallel.offload", "cpu"},
                                   {"parallel.offload_budget_mb", "0.01"},
                                   {"train.memory_check", "off"}});
  const RankMemory r = one_rank(c);
  ASSERT_GT(r.offload_piece, 0);
  const std::optional<std::string> why = offload_budget_refusal(r);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("parallel.offload_budget_mb = 0.01"), std::string::npos) << *why;
  EXPECT_NE(why->find(fmt::format(">= {:.2f}", std::ceil(2 * r.offload_piece / 1048576 * 100) / 100)),
            std::string::npos)
      << *why;
  TrainerOptions options;
  options.console = false;
  EXPECT_THROW(Trainer(c, options), Error);
  c.parallel.offload_budget_mb = 1;  // two pieces of a tiny model fit
  EXPECT_FALSE(offload_budget_refusal(one_rank(c)).has_value());
}

}  // namespace
}  // namespace meshtrain
