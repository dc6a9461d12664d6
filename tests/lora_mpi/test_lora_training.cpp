// LoRA training runs (whole Trainer): the frozen base is bit-identical after
// training, the memory tracker matches train/memory_plan exactly, DDP (dp =
// world), ZeRO 1/2, tp 2 (± sequence parallel) and pp 2 equal the
// single-rank run on the same global batch, and a resume continues bit for
// bit (ZeRO-2 and tp 2 checkpoints also on one rank); its checkpoints hold no
// optimizer state for the frozen base, and --resume auto falls back past a
// corrupt one.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/ckpt/lora_export.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/model/model.h"
#include "meshtrain/parallel/zero/memory.h"
#include "meshtrain/parallel/zero/sharded.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/memory_expect.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;
using testing::run_trainer;
using LoraRun = testing::TrainerRun;

const std::string kHfLlama =
    std::string(MESHTRAIN_SOURCE_DIR) + "/tests/reference/fixtures/hf_tiny_llama_theta1e4_gqa_untied";

class LoraTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::shared_scratch_dir(*world_);
    if (world_->rank() == 0) testing::write_phrase_corpus(dir_, 64);
    world_->barrier();
  }

  // Every target: under tp both column-parallel (A replicated, B split) and
  // row-parallel (A split, x A^T all-reduced) adapters. family "hf": the
  // model and its base weights come from the HF llama fixture (train.init_from);
  // "hf_base": the same without [lora] (a full fine-tune).
  TrainConfig config(const std::string& out, const std::string& family,
                     ConfigOverrides extra = {}) const {
    const bool hf = family == "hf" || family == "hf_base";
    if (hf) extra.insert(extra.begin(), {"train.init_from", kHfLlama});
    const std::string lora = family == "hf_base" ? "" : "[lora]\nrank = 4\nalpha = 8\ntargets = ";
    const std::string model =
        hf ? ""
        : family == "llama" ? "family = \"llama\"\ndim = 32\nn_layers = 2\nn_heads = 4\n"
                            "n_kv_heads = 2\nhidden_dim = 64\nvocab_size = 64\nmax_seq_len = 32\n"
                            "tie_embeddings = false\n"
                          : "family = \"gpt2\"\ndim = 32\nn_layers = 2\nn_heads = 4\n"
                            "hidden_dim = 128\nvocab_size = 64\nmax_seq_len = 32\n";
    const std::string targets = family != "gpt2"
                                    ? R"(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"])"
                                    : R"(["c_attn", "c_proj", "c_fc"])";
    return testing::tiny_run_config("[model]\n" + model + R"(
[train]
steps = 10
batch_size = 8
seq_len = 16
threads = 1
grad_clip = 1.0
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
[optim]
lr = 1e-2
warmup_steps = 2
)" + lora + (lora.empty() ? "" : targets) + R"(
[data]
tokenizer = "bytes"
)",
                                    dir_, out, std::move(extra), "lora.toml");
  }

  std::string rank_dir(const std::string& name) const {
    return name + ".rank" + std::to_string(world_->rank());
  }

  static void expect_close(const LoraRun& run, const LoraRun& ref, const std::string& what) {
    ASSERT_EQ(run.records.size(), ref.records.size()) << what;
    for (size_t i = 0; i < ref.records.size(); ++i) {
      EXPECT_NEAR(run.records[i].loss, ref.records[i].loss, 1e-5 * std::fabs(ref.records[i].loss))
          << what << ": step " << i + 1;
    }
    ASSERT_EQ(run.weights.size(), ref.weights.size()) << what;
    float worst = 0;
    for (size_t i = 0; i < ref.weights.size(); ++i) {
      worst = std::max(worst, std::fabs(run.weights[i] - ref.weights[i]));
    }
    // 2e-5: the sanitizer build (-O1, sums not vectorised) reached 1.4e-5 (lora.np2).
    EXPECT_LE(worst, 2e-5f) << what << ": largest weight difference";
  }

  void expect_resumes_on_one_rank(const std::string& name, ConfigOverrides layout,
                                  DeviceMesh& mesh);

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(LoraTraining, BaseStaysBitIdenticalAdaptersLearnAndMemoryMatchesThePlan) {
  for (const char* family : {"llama", "gpt2"}) {
    for (const char* precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string(family) + " " + precision);
      const TrainConfig c = config(rank_dir(std::string("single_") + family + precision), family,
                                   {{"train.precision", precision}});
      LoraRun run = run_trainer(c, nullptr);
      EXPECT_LT(run.records.back().loss, run.records.front().loss) << "the adapters learn";
      testing::expect_memory_matches(run.predicted, run.memory,
                                     std::string("lora ") + family + " " + precision);
      // The initial model, for the frozen values (bf16: what the run holds).
      MemoryTracker tracker;
      cpu::CpuBackend ctx(1, tracker);
      Model init(c.model, c.train.precision, ctx);
      init.init_weights(c.train.seed);
      std::vector<float> initial(static_cast<size_t>(init.num_params()));
      init.read_values(0, init.num_params(), initial.data());
      ASSERT_EQ(run.weights.size(), initial.size());
      int64_t trainable = 0;
      for (const Parameter& p : init.params()) {
        const bool same = std::memcmp(run.weights.data() + p.offset, initial.data() + p.offset,
                                      static_cast<size_t>(p.spec.numel()) * 4) == 0;
        if (!p.spec.trainable) {
          EXPECT_TRUE(same) << p.spec.name << " (frozen) changed";
        }
        if (p.spec.trainable) {
          EXPECT_FALSE(same) << p.spec.name << " (adapter) did not train";
        }
        if (p.spec.trainable) trainable += p.spec.numel();
      }
      // Gradients and optimizer state: the adapters only.
      EXPECT_EQ(run.memory.peak[static_cast<size_t>(MemCategory::grads)],
                static_cast<size_t>(trainable) * 4);
      EXPECT_EQ(run.memory.peak[static_cast<size_t>(MemCategory::optimizer)],
                static_cast<size_t>(trainable) * 8);
    }
  }
}

TEST_F(LoraTraining, DataAndTensorAndPipelineParallelMatchSingleRank) {
  for (const char* family : {"llama", "gpt2"}) {
    SCOPED_TRACE(family);
    LoraRun ref = run_trainer(config(rank_dir(std::string("ref_") + family), family), nullptr);
    DeviceMesh dp_mesh(*world_, 1, 1);
    LoraRun ddp = run_trainer(config(std::string("ddp_") + family, family), &dp_mesh);
    expect_close(ddp, ref, "dp = world (DDP)");
    testing::expect_memory_matches(ddp.predicted, ddp.memory, std::string("lora ddp ") + family);
    for (const char* zero : {"1", "2", "3"}) {
      for (const char* precision : {"fp32", "bf16"}) {
        const std::string what = std::string("zero ") + zero + " " + precision;
        const ConfigOverrides extra{{"parallel.zero", zero}, {"train.precision", precision}};
        LoraRun sharded = run_trainer(
            config(std::string("zero") + zero + precision + "_" + family, family, extra), &dp_mesh);
        if (std::string(precision) == "fp32") expect_close(sharded, ref, what);
        testing::expect_memory_matches(sharded.predicted, sharded.memory,
                                       "lora " + what + " " + family);
      }
    }
    if (world_->size() != 2) continue;
    DeviceMesh tp_mesh(*world_, 2, 1);
    LoraRun tp = run_trainer(config(std::string("tp_") + family, family, {{"parallel.tp", "2"}}),
                         &tp_mesh);
    expect_close(tp, ref, "tp 2");
    testing::expect_memory_matches(tp.predicted, tp.memory, std::string("lora tp 2 ") + family);
    LoraRun sp = run_trainer(config(std::string("sp_") + family, family,
                                    {{"parallel.tp", "2"}, {"parallel.sequence_parallel", "true"}}),
                             &tp_mesh);
    expect_close(sp, ref, "tp 2, sequence parallel");
    testing::expect_memory_matches(sp.predicted, sp.memory, std::string("lora sp 2 ") + family);
    DeviceMesh pp_mesh(*world_, 1, 2);
    LoraRun pp = run_trainer(config(std::string("pp_") + family, family,
                                {{"parallel.pp", "2"}, {"train.micro_batch_size", "2"}}),
                         &pp_mesh);
    expect_close(pp, ref, "pp 2");
    testing::expect_memory_matches(pp.predicted, pp.memory, std::string("lora pp 2 ") + family);
  }
}

// QLoRA (lora.quantize_base = nf4) under ZeRO: the packed base is a frozen
// flat like any other (zero/flat_param.h): at stage 3 each rank holds its
// shard of the packed words, a unit's gather gives the single rank's bytes
// back bit for bit, and training equals the single-rank run with every
// memory category as the plan predicts.
TEST_F(LoraTraining, QloraPackedBaseIsShardedAtZeroThree) {
  const ConfigOverrides qlora{{"lora.quantize_base", "nf4"}};
  const TrainConfig c = config(rank_dir("qlora_layout"), "llama", qlora);
  MemoryTracker flat_tracker, tracker;
  cpu::CpuBackend flat_ctx(1, flat_tracker), ctx(1, tracker);
  Model whole(c.model, Precision::bf16, flat_ctx);
  whole.init_weights(c.train.seed);
  Model model(c.model, Precision::bf16, ctx, ParamStorage::external);
  zero::ZeroOptions options;
  options.stage = 3;
  zero::ShardedDataParallel dp(model, *world_, AdamWConfig{}, options);
  dp.init_weights(c.train.seed);
  int64_t words = 0, held = 0;
  for (const zero::FlatParam& f : dp.layout().flats) {
    if (!f.packed) continue;
    words += f.numel;
    held += f.shard;
    EXPECT_FALSE(f.trainable);
    EXPECT_EQ(f.shard, (f.numel + world_->size() - 1) / world_->size());
  }
  int64_t nf4_bytes = 0;
  for (const Parameter& p : whole.params()) nf4_bytes += p.spec.nf4 ? p.nf4.bytes() : 0;
  ASSERT_GT(nf4_bytes, 0);
  EXPECT_EQ(4 * words, nf4_bytes);
  EXPECT_EQ(tracker.live(MemCategory::params),
            zero::layout_model_state_bytes(dp.layout(), 3).params);
  if (world_->size() > 1) {
    EXPECT_LT(4 * held, nf4_bytes) << "each rank holds a shard of the packed base";
  }
  for (size_t u = 0; u < model.units().size(); ++u) {
    model.unit_hooks.before(u, UnitPass::forward);
    for (size_t i = model.units()[u].first_param; i < model.units()[u].end_param; ++i) {
      const Parameter& p = model.params()[i];
      if (!p.spec.nf4) continue;
      const Parameter& w = whole.params()[i];
      ASSERT_TRUE(p.nf4.defined()) << p.spec.name << " is not gathered";
      EXPECT_EQ(std::memcmp(p.nf4.raw(), w.nf4.raw(), w.nf4.bytes()), 0) << p.spec.name;
    }
    model.unit_hooks.after(u, UnitPass::forward);
  }
  dp.quiesce();

  LoraRun ref = run_trainer(config(rank_dir("qlora_ref"), "llama", qlora), nullptr);
  DeviceMesh dp_mesh(*world_, 1, 1);
  for (const char* zero : {"1", "3"}) {
    for (const char* precision : {"fp32", "bf16"}) {
      const std::string what = std::string("qlora zero ") + zero + " " + precision;
      ConfigOverrides extra = qlora;
      extra.push_back({"parallel.zero", zero});
      extra.push_back({"train.precision", precision});
      LoraRun run = run_trainer(
          config(std::string("qlora_zero") + zero + precision, "llama", extra), &dp_mesh);
      if (std::string(precision) == "fp32") expect_close(run, ref, what);
      testing::expect_memory_matches(run.predicted, run.memory, what);
    }
  }
}

// Adapter dropout is keyed by (seed, step, sample, position, feature): DDP,
// ZeRO-2, tp 2 and another micro-batch split give the single-rank run.
TEST_F(LoraTraining, DropoutIsLayoutIndependent) {
  const ConfigOverrides drop{{"lora.dropout", "0.2"}};
  auto with = [&](ConfigOverrides extra) {
    extra.insert(extra.end(), drop.begin(), drop.end());
    return extra;
  };
  LoraRun ref = run_trainer(config(rank_dir("drop_ref"), "llama", drop), nullptr);
  LoraRun plain = run_trainer(config(rank_dir("drop_none"), "llama"), nullptr);
  EXPECT_NE(ref.records.back().loss, plain.records.back().loss) << "dropout changes the run";
  // The dropout's masks and dropped inputs are workspace the plan predicts.
  testing::expect_memory_matches(ref.predicted, ref.memory, "lora dropout");
  LoraRun bf16 = run_trainer(
      config(rank_dir("drop_bf16"), "llama", with({{"train.precision", "bf16"}})), nullptr);
  testing::expect_memory_matches(bf16.predicted, bf16.memory, "lora dropout bf16");
  LoraRun split = run_trainer(
      config(rank_dir("drop_split"), "llama", with({{"train.micro_batch_size", "2"}})), nullptr);
  expect_close(split, ref, "dropout, micro-batches of 2");
  DeviceMesh dp_mesh(*world_, 1, 1);
  expect_close(run_trainer(config("drop_ddp", "llama", drop), &dp_mesh), ref, "dropout, DDP");
  expect_close(run_trainer(config("drop_zero", "llama", with({{"parallel.zero", "2"}})), &dp_mesh),
               ref, "dropout, ZeRO-2");
  if (world_->size() != 2) return;
  DeviceMesh tp_mesh(*world_, 2, 1);
  LoraRun tp = run_trainer(config("drop_tp", "llama", with({{"parallel.tp", "2"}})), &tp_mesh);
  expect_close(tp, ref, "dropout, tp 2");
  testing::expect_memory_matches(tp.predicted, tp.memory, "lora dropout tp 2");
}

TEST_F(LoraTraining, ResumeContinuesBitForBit) {
  DeviceMesh mesh(*world_, 1, 1);
  LoraRun full = run_trainer(config("full", "llama", {{"train.checkpoint_interval", "5"}}), &mesh);
  world_->barrier();
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/full/step_5/manifest.json"));
  LoraRun rest = run_trainer(config("resumed", "llama"), &mesh, dir_ + "/full/step_5");
  ASSERT_EQ(rest.records.size(), 5u);
  for (size_t i = 0; i < rest.records.size(); ++i) {
    EXPECT_EQ(rest.records[i].loss, full.records[5 + i].loss) << "step " << rest.records[i].step;
  }
  ASSERT_EQ(rest.weights.size(), full.weights.size());
  EXPECT_EQ(std::memcmp(rest.weights.data(), full.weights.data(), full.weights.size() * 4), 0);
}

// A checkpoint of `layout` (over the whole world) at step 5, resumed on one
// rank through the shard map, continues the run.
void LoraTraining::expect_resumes_on_one_rank(const std::string& name, ConfigOverrides layout,
                                              DeviceMesh& mesh) {
  layout.push_back({"train.checkpoint_interval", "5"});
  LoraRun full = run_trainer(config(name, "llama", layout), &mesh);
  world_->barrier();
  LoraRun single = run_trainer(config(rank_dir(name + "_resumed"), "llama"), nullptr,
                               dir_ + "/" + name + "/step_5");
  ASSERT_EQ(single.records.size(), 5u);
  for (size_t i = 0; i < single.records.size(); ++i) {
    EXPECT_NEAR(single.records[i].loss, full.records[5 + i].loss,
                1e-5 * std::fabs(full.records[5 + i].loss))
        << name << ": step " << single.records[i].step;
  }
  world_->barrier();  // every rank has read the checkpoint
}

// train.init_from the HF fixture into LoRA: every rank reads its pieces of
// the base (ZeRO-2: the frozen base written shard by shard; tp 2: sliced),
// the adapters keep their init; the runs equal the single-rank one.
TEST_F(LoraTraining, InitFromHuggingFaceMatchesSingleRank) {
  LoraRun ref = run_trainer(config(rank_dir("hf_ref"), "hf"), nullptr);
  EXPECT_LT(ref.records.back().loss, ref.records.front().loss);
  DeviceMesh dp_mesh(*world_, 1, 1);
  expect_close(run_trainer(config("hf_zero2", "hf", {{"parallel.zero", "2"}}), &dp_mesh), ref,
               "init_from HF, ZeRO-2");
  if (world_->size() != 2) return;
  DeviceMesh tp_mesh(*world_, 2, 1);
  expect_close(run_trainer(config("hf_tp", "hf", {{"parallel.tp", "2"}}), &tp_mesh), ref,
               "init_from HF, tp 2");

  // init_from a non-LoRA training checkpoint written at tp 2 (sharded by
  // columns / rows): one rank and ZeRO-2 over dp 2 read its base by region overlap.
  run_trainer(config("hf_base_tp", "hf_base",
                     {{"parallel.tp", "2"}, {"train.steps", "2"}, {"train.checkpoint_interval", "2"}}),
              &tp_mesh);
  world_->barrier();
  const ConfigOverrides from_tp{{"train.init_from", dir_ + "/hf_base_tp/step_2"}};
  LoraRun single = run_trainer(config(rank_dir("tp_ckpt_ref"), "hf", from_tp), nullptr);
  ConfigOverrides zero2 = from_tp;
  zero2.push_back({"parallel.zero", "2"});
  expect_close(run_trainer(config("tp_ckpt_zero2", "hf", zero2), &dp_mesh), single,
               "init_from a tp 2 checkpoint, ZeRO-2");
  EXPECT_GT(std::fabs(single.records.front().loss - ref.records.front().loss), 1e-4)
      << "the checkpoint's base, not HF's";
}

// ZeRO-2 (adapters' states sharded, the frozen base written shard by shard)
// and tp 2 (adapters' B split by rows or A by columns, the base split as usual).
TEST_F(LoraTraining, ZeroAndTensorParallelCheckpointsReshardToOneRank) {
  DeviceMesh dp_mesh(*world_, 1, 1);
  expect_resumes_on_one_rank("zero2", {{"parallel.zero", "2"}}, dp_mesh);
  if (world_->size() != 2) return;
  DeviceMesh tp_mesh(*world_, 2, 1);
  expect_resumes_on_one_rank("tp2", {{"parallel.tp", "2"}}, tp_mesh);
}

// The three states of a run, whole, in the single-rank layout.
struct GatheredState {
  std::vector<float> states[layout::kStateKinds];
  bool operator==(const GatheredState& o) const {
    for (size_t k = 0; k < layout::kStateKinds; ++k) {
      if (states[k].size() != o.states[k].size() ||
          std::memcmp(states[k].data(), o.states[k].data(), states[k].size() * 4) != 0) {
        return false;
      }
    }
    return true;
  }
};

GatheredState run_and_gather(const TrainConfig& c, DeviceMesh* mesh, const std::string& resume) {
  TrainerOptions options;
  options.console = false;
  options.mesh = mesh;
  options.resume_dir = resume;
  Trainer trainer(c, options);
  trainer.run();
  GatheredState out;
  for (size_t k = 0; k < layout::kStateKinds; ++k) {
    out.states[k] = trainer.gather_state(static_cast<layout::StateKind>(k));
  }
  return out;
}

// A LoRA checkpoint holds the frozen base's master weights and nothing else
// of it: its moments are neither stored (the manifest lists master only) nor
// needed; one rank and another layout load the state back bit for bit.
TEST_F(LoraTraining, CheckpointHoldsNoOptimizerStateForTheFrozenBase) {
  DeviceMesh mesh(*world_, 1, 1);
  const ConfigOverrides at5{{"train.steps", "5"}, {"train.checkpoint_interval", "5"},
                            {"parallel.zero", "1"}};
  const GatheredState saved = run_and_gather(config("frozen", "llama", at5), &mesh, "");
  world_->barrier();
  const std::string dir = dir_ + "/frozen/step_5";
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(dir);
  int64_t base = 0, adapters = 0;
  for (const dist_ckpt::ManifestTensor& t : m.tensors) {
    const bool lora = is_lora_tensor(t.name);
    (lora ? adapters : base) += shape_numel(t.shape);
    EXPECT_EQ(t.states, lora ? layout::StateSet{} : layout::StateSet::master_only()) << t.name;
  }
  ASSERT_TRUE(base > 0 && adapters > 0);
  uint64_t data = 0;
  for (const dist_ckpt::ManifestFile& f : m.files) {
    if (!f.name.starts_with("rank_")) continue;
    SafetensorsReader reader(dir + "/" + f.name);
    data += f.bytes - reader.data_start();
  }
  EXPECT_EQ(data, static_cast<uint64_t>(base + 3 * adapters) * 4) << "no moments of the base";
  for (size_t k = 1; k < layout::kStateKinds; ++k) {  // the adapters' moments are there
    EXPECT_TRUE(std::any_of(saved.states[k].begin(), saved.states[k].end(),
                            [](float v) { return v != 0.0f; }));
  }

  // Resumed with no steps left: the state is the checkpoint's, bit for bit.
  const ConfigOverrides none{{"train.steps", "5"}};
  EXPECT_TRUE(run_and_gather(config(rank_dir("frozen_single"), "llama", none), nullptr, dir) ==
              saved)
      << "one rank";
  ConfigOverrides zero2 = none;
  zero2.push_back({"parallel.zero", "2"});
  EXPECT_TRUE(run_and_gather(config("frozen_zero2", "llama", zero2), &mesh, dir) == saved)
      << "ZeRO-2";
  if (world_->size() == 2) {
    DeviceMesh tp_mesh(*world_, 2, 1);
    ConfigOverrides tp = none;
    tp.push_back({"parallel.tp", "2"});
    EXPECT_TRUE(run_and_gather(config("frozen_tp", "llama", tp), &tp_mesh, dir) == saved)
        << "tp 2";
  }
  world_->barrier();
}

// This rank's resume event in its metrics file.
nlohmann::json resume_event(const std::string& out_dir, int rank) {
  std::ifstream in(out_dir + "/" + metrics_file_name(rank));
  nlohmann::json found;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (record.value("event", "") == "resume") found = record;
  }
  return found;
}

// --resume auto past a checkpoint with one rank's file corrupt: the load finds
// it (checksums over the bytes as they are read, each byte once), every rank
// falls back to the older checkpoint and the run continues bit for bit.
TEST_F(LoraTraining, ResumeAutoFallsBackPastACorruptCheckpoint) {
  DeviceMesh mesh(*world_, 1, 1);
  const ConfigOverrides every2{{"train.checkpoint_interval", "2"}, {"parallel.zero", "1"},
                               {"train.steps", "6"}};
  LoraRun full = run_trainer(config("fallback_full", "llama", every2), &mesh);
  ConfigOverrides four = every2;
  four.push_back({"train.steps", "4"});
  run_trainer(config("fallback", "llama", four), &mesh);
  world_->barrier();
  const std::string out = dir_ + "/fallback";
  const std::string damaged =
      out + "/step_4/" + fmt::format("rank_{}.safetensors", world_->size() - 1);
  const auto file_bytes = [&](const std::string& step) {
    const std::string path = out + "/" + step + "/" + fmt::format("rank_{}.safetensors", world_->rank());
    return std::filesystem::file_size(path) + SafetensorsReader(path).data_start();
  };
  const uint64_t expected = file_bytes("step_4") + file_bytes("step_2");
  world_->barrier();
  if (world_->rank() == 0) {
    std::fstream f(damaged, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(std::filesystem::file_size(damaged) / 2));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(damaged) / 2));
    f.write(&c, 1);
  }
  world_->barrier();

  TrainerOptions options;
  options.console = false;
  options.mesh = &mesh;
  options.resume_dir = "auto";
  std::vector<StepRecord> records;
  {
    Trainer trainer(config("fallback", "llama", every2), options);
    EXPECT_EQ(trainer.resumed_from(), out + "/step_2");
    records = trainer.run();
  }
  ASSERT_EQ(records.size(), 4u);
  for (size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i].loss, full.records[2 + i].loss) << "step " << records[i].step;
  }
  const nlohmann::json event = resume_event(out, world_->rank());
  ASSERT_TRUE(event.is_object());
  EXPECT_EQ(event["from"], out + "/step_2");
  EXPECT_EQ(event["load_bytes"].get<uint64_t>(), expected) << "each file read once";
  world_->barrier();
}

}  // namespace
}  // namespace meshtrain
