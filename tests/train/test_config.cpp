// Config parsing: every bad key, type and value is rejected with a message
// naming the key; overrides go through the same checks; docs cover every key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "meshtrain/train/checkpoint.h"
#include "meshtrain/model/params.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/trace_hook.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

const char* kBase = R"(
[model]
preset = "llama-tiny"
[train]
steps = 10
batch_size = 4
seq_len = 32
[data]
train = "train.bin"
)";

// The Error message of parsing `text` with `overrides`, or "" when it parses.
std::string error_of(const std::string& text, const ConfigOverrides& overrides = {}) {
  try {
    parse_config(text, "run.toml", overrides);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, ParsesPresetAndDefaults) {
  TrainConfig c = parse_config(kBase, "run.toml");
  EXPECT_EQ(c.model_preset, "llama-tiny");
  EXPECT_EQ(c.model.vocab_size, model_preset("llama-tiny").vocab_size);
  EXPECT_EQ(c.train.steps, 10);
  EXPECT_EQ(c.train.micro_batch_size, 4);  // 0 -> batch_size
  EXPECT_EQ(c.train.grad_accum_steps(), 1);
  EXPECT_EQ(c.train.precision, Precision::fp32);
  ASSERT_EQ(c.data.train.size(), 1u);
  EXPECT_EQ(c.data.train[0], "train.bin");
  EXPECT_TRUE(c.data.val.empty());
}

TEST(Config, ExplicitModelFieldsOverridePreset) {
  TrainConfig c = parse_config(std::string(kBase) + "", "run.toml",
                               {{"model.dim", "32"}, {"model.n_layers", "3"}});
  EXPECT_EQ(c.model.dim, 32);
  EXPECT_EQ(c.model.n_layers, 3);
  EXPECT_EQ(c.model.n_heads, model_preset("llama-tiny").n_heads);

  TrainConfig e = parse_config(R"(
[model]
family = "gpt2"
dim = 32
n_layers = 2
n_heads = 4
hidden_dim = 128
vocab_size = 256
max_seq_len = 64
[train]
seq_len = 64
[data]
train = ["a.bin", "b*.bin"]
)",
                               "run.toml");
  EXPECT_EQ(e.model.family, Family::gpt2);
  EXPECT_EQ(e.model.n_kv_heads, 4);  // defaults to n_heads
  EXPECT_EQ(e.data.train.size(), 2u);
}

TEST(Config, UnknownKeysAndSectionsNamed) {
  EXPECT_EQ(error_of(std::string(kBase) + "[train.x]\n"),
            "config: unknown key 'train.x'");  // a sub-table is a key of [train]
  EXPECT_EQ(error_of(kBase, {{"train.stepz", "3"}}), "config: unknown key 'train.stepz'");
  std::string text = kBase;
  text.replace(text.find("steps"), 5, "stepz");
  EXPECT_EQ(error_of(text), "config: unknown key 'train.stepz'");
  EXPECT_EQ(error_of(std::string(kBase) + "[trian]\nsteps = 1\n"), "config: unknown section 'trian'");
  EXPECT_EQ(error_of(std::string("lr = 1\n") + kBase),
            "config: unknown key 'lr' (keys belong in [model], [train], [optim] or [data])");
}

TEST(Config, WrongTypesNamed) {
  std::string text = kBase;
  text.replace(text.find("steps = 10"), 10, "steps = \"10\"");
  EXPECT_EQ(error_of(text), "config: train.steps must be an integer, got \"10\"");
  EXPECT_EQ(error_of(kBase, {{"train.steps", "ten"}}),
            "config: train.steps must be an integer, got \"ten\"");
  EXPECT_EQ(error_of(kBase, {{"optim.lr", "fast"}}), "config: optim.lr must be a number, got \"fast\"");
  EXPECT_EQ(error_of(kBase, {{"model.tie_embeddings", "yes"}}),
            "config: model.tie_embeddings must be a boolean (true or false), got \"yes\"");
  EXPECT_EQ(error_of(std::string(kBase) + "[optim]\nlr = true\n"),
            "config: optim.lr must be a number, got true");
  EXPECT_EQ(error_of(std::string(kBase) + "[optim]\ndecay = 3\n"),
            "config: optim.decay must be a string, got 3");
}

TEST(Config, InvalidValuesNamed) {
  EXPECT_EQ(error_of(kBase, {{"train.precision", "fp8"}}),
            "config: train.precision must be \"fp32\", \"bf16\" or \"fp16\", got \"fp8\"");
  EXPECT_EQ(error_of(kBase, {{"optim.decay", "linear"}}),
            "config: optim.decay must be \"cosine\" or \"constant\", got \"linear\"");
  EXPECT_EQ(error_of(kBase, {{"train.steps", "0"}}), "config: train.steps must be >= 1, got 0");
  EXPECT_EQ(error_of(kBase, {{"train.micro_batch_size", "3"}}),
            "config: train.batch_size (4) must be a multiple of train.micro_batch_size (3)");
  EXPECT_NE(error_of(kBase, {{"train.seq_len", "100000"}}).find("train.seq_len"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"optim.beta2", "1"}}).find("optim.beta2"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"optim.lr", "-1"}}).find("optim.lr"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"optim.min_lr", "1"}}).find("optim.min_lr"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"model.preset", "llama-7T"}}).find("model.preset"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"model.family", "rwkv"}}).find("model.family"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"model.n_heads", "5"}}).find("model.n_heads"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"train.threads", "-1"}}).find("train.threads"), std::string::npos);
  std::string no_data = kBase;
  no_data.erase(no_data.find("[data]"));
  EXPECT_NE(error_of(no_data).find("data.train"), std::string::npos);
}

TEST(Config, TraceStepsParsedOrNamed) {
  EXPECT_EQ(parse_config(kBase, "run.toml", {}).train.trace_steps, "");  // off by default
  EXPECT_EQ(parse_config(kBase, "run.toml", {{"train.trace_steps", "10-12"}}).train.trace_steps,
            "10-12");
  EXPECT_EQ(parse_trace_steps("10-12"), std::make_pair(int64_t{10}, int64_t{12}));
  EXPECT_EQ(parse_trace_steps("7"), std::make_pair(int64_t{7}, int64_t{7}));
  for (const char* bad : {"0", "3-", "-3", "a-b", "12-10", "1-2-3", "1.5"}) {
    EXPECT_NE(error_of(kBase, {{"train.trace_steps", bad}}).find("train.trace_steps"),
              std::string::npos)
        << bad;
  }
}

TEST(Config, GlobalBatchInTokens) {
  std::string text = kBase;
  text.erase(text.find("batch_size = 4\n"), 15);
  TrainConfig c = parse_config(text, "run.toml", {{"train.batch_tokens", "256"}});
  EXPECT_EQ(c.train.batch_size, 8);  // 256 tokens / seq_len 32
  EXPECT_EQ(c.train.tokens_per_step(), 256);
  EXPECT_EQ(c.train.micro_batch_size, 8);
  // Given with a batch_size that agrees: fine; one that disagrees: named.
  EXPECT_EQ(error_of(kBase, {{"train.batch_tokens", "128"}}), "");
  EXPECT_EQ(error_of(kBase, {{"train.batch_tokens", "256"}}),
            "config: train.batch_size (4) contradicts train.batch_tokens (256 = 8 sequences of "
            "32); give one of them");
  EXPECT_EQ(error_of(text, {{"train.batch_tokens", "100"}}),
            "config: train.batch_tokens (100) must be a multiple of train.seq_len (32)");
}

TEST(Config, RecomputeKeys) {
  EXPECT_EQ(parse_config(kBase, "run.toml").train.recompute, Recompute::none);
  const TrainConfig c = parse_config(kBase, "run.toml",
                                     {{"train.recompute", "full"}, {"train.recompute_layers", "1"}});
  EXPECT_EQ(c.train.recompute, Recompute::full);
  EXPECT_EQ(c.train.recompute_layers, 1);
  const TrainConfig back = config_from_json(config_to_json(c));
  EXPECT_EQ(back.train.recompute, Recompute::full);
  EXPECT_EQ(back.train.recompute_layers, 1);
  // Bit-exact, so a resume may switch it.
  EXPECT_TRUE(resume_config_changes(parse_config(kBase, "run.toml"), c).empty());
  EXPECT_EQ(error_of(kBase, {{"train.recompute", "some"}}),
            "config: train.recompute must be \"none\", \"selective\" or \"full\", got \"some\"");
  EXPECT_EQ(error_of(kBase, {{"train.recompute", "selective"}, {"train.recompute_layers", "2"}}),
            "config: train.recompute_layers (2) needs train.recompute = \"full\"");
  EXPECT_NE(error_of(kBase, {{"train.recompute_layers", "-1"}}).find("train.recompute_layers"),
            std::string::npos);
}

TEST(Config, SyntaxErrorNamesFileAndLine) {
  std::string msg = error_of("[train]\nsteps = = 3\n");
  EXPECT_EQ(msg.rfind("config: run.toml:2:", 0), 0u) << msg;
}

TEST(Config, OverridesApplyOnTopOfFile) {
  TrainConfig c = parse_config(kBase, "run.toml",
                               {{"train.steps", "77"},
                                {"optim.lr", "1e-3"},
                                {"train.precision", "bf16"},
                                {"data.val", "v.bin"},
                                {"data.tokenizer", "bytes"},
                                {"model.tie_embeddings", "true"}});
  EXPECT_EQ(c.train.steps, 77);
  EXPECT_FLOAT_EQ(c.optim.lr, 1e-3f);
  EXPECT_EQ(c.train.precision, Precision::bf16);
  EXPECT_EQ(c.data.val, std::vector<std::string>{"v.bin"});
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.data.tokenizer, "bytes");
  EXPECT_EQ(c.data.gpt2_ranks, "data/gpt2.tiktoken");
  EXPECT_NE(error_of(std::string(kBase) + "tokenizer = \"\"\n").find("data.tokenizer must not be empty"),
            std::string::npos);
}

TEST(Config, RoundTripsThroughTomlAndJson) {
  TrainConfig c = parse_config(kBase, "run.toml",
                               {{"optim.lr", "3e-4"}, {"optim.min_lr", "1.234567e-5"},
                                {"model.norm_eps", "1e-6"}, {"train.seed", "42"}});
  for (const TrainConfig& back :
       {parse_config(config_to_toml(c), "saved.toml"), config_from_json(config_to_json(c))}) {
    EXPECT_EQ(config_to_toml(back), config_to_toml(c));
    EXPECT_EQ(back.optim.lr, c.optim.lr);
    EXPECT_EQ(back.optim.min_lr, c.optim.min_lr);
    EXPECT_EQ(back.model.norm_eps, c.model.norm_eps);
    EXPECT_EQ(back.train.seed, 42u);
  }
}

TEST(Config, EveryKeyDocumented) {
  std::ifstream in(MESHTRAIN_SOURCE_DIR "/docs/config.md");
  ASSERT_TRUE(in.good()) << "docs/config.md missing";
  std::stringstream text;
  text << in.rdbuf();
  for (const std::string& key : config_keys()) {
    EXPECT_NE(text.str().find("`" + key + "`"), std::string::npos) << key << " is not in docs/config.md";
  }
}

TEST(Config, ExampleConfigsParse) {
  int configs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(MESHTRAIN_SOURCE_DIR "/configs")) {
    if (entry.path().extension() != ".toml") continue;
    EXPECT_NO_THROW(load_config(entry.path().string())) << entry.path();
    ++configs;
  }
  EXPECT_GE(configs, 7);
}

}  // namespace
}  // namespace meshtrain

namespace meshtrain {
namespace {

TEST(Config, CommDeadlinesAndRecorder) {
  const TrainConfig defaults = parse_config(kBase, "test.toml");
  EXPECT_EQ(defaults.comm.timeout_s, 300);
  EXPECT_EQ(defaults.comm.long_timeout_s, 3600);
  EXPECT_EQ(defaults.comm.flight_records, 1024);
  const TrainConfig c = parse_config(kBase, "test.toml", {{"comm.timeout_s", "2.5"}});
  EXPECT_EQ(c.comm.timeout_s, 2.5);
  EXPECT_EQ(parse_config(config_to_toml(c), "saved.toml").comm.timeout_s, 2.5);
  EXPECT_EQ(error_of(kBase, {{"comm.timeout_s", "-1"}}),
            "config: comm.timeout_s must be >= 0 (0 = no deadline), got -1");
  EXPECT_NE(error_of(kBase, {{"comm.flight_records", "0"}})
                .find("set comm.timeout_s and comm.long_timeout_s to 0"),
            std::string::npos);
}

TEST(Config, CommBackendNamesTheKey) {
  EXPECT_EQ(parse_config(kBase, "test.toml").comm.backend, "auto");
  const TrainConfig c = parse_config(kBase, "test.toml", {{"comm.backend", "mpi"}});
  EXPECT_EQ(parse_config(config_to_toml(c), "saved.toml").comm.backend, "mpi");
  EXPECT_EQ(error_of(kBase, {{"comm.backend", "gloo"}}),
            "config: comm.backend must be \"auto\", \"mpi\" or \"nccl\", got \"gloo\"");
  EXPECT_NE(error_of(kBase, {{"comm.backend", "nccl"}})
                .find("comm.backend = \"nccl\" moves device memory, and train.device = \"cpu\""),
            std::string::npos);
}

}  // namespace
}  // namespace meshtrain

namespace meshtrain {
namespace {

TEST(Config, LoraKeysParsedSavedAndNamedWhenInvalid) {
  TrainConfig off = parse_config(kBase, "run.toml");
  EXPECT_FALSE(off.model.lora.enabled());
  EXPECT_EQ(config_to_toml(off).find("[lora]"), std::string::npos) << "no section when off";

  const std::string with = std::string(kBase) + "[lora]\nrank = 8\nalpha = 32\n";
  TrainConfig c = parse_config(with, "run.toml");
  EXPECT_EQ(c.model.lora.rank, 8);
  EXPECT_EQ(c.model.lora.scale(), 4.0f);
  EXPECT_EQ(c.model.lora.targets, (std::vector<std::string>{"q_proj", "v_proj"}));  // llama default
  for (const TrainConfig& back :
       {parse_config(config_to_toml(c), "saved.toml"), config_from_json(config_to_json(c))}) {
    EXPECT_EQ(back.model.lora, c.model.lora);
  }
  TrainConfig gpt2 = parse_config(kBase, "run.toml", {{"model.preset", "gpt2-124M"},
                                                      {"lora.rank", "4"}});
  EXPECT_EQ(gpt2.model.lora.targets, (std::vector<std::string>{"c_attn"}));

  EXPECT_EQ(error_of(with, {{"lora.targets", "c_attn"}}),
            "config: lora.targets: \"c_attn\" is not a llama module; choose from q_proj, k_proj, "
            "v_proj, o_proj, gate_proj, up_proj, down_proj");
  EXPECT_NE(error_of(with, {{"lora.rank", "-1"}}).find("lora.rank"), std::string::npos);
  EXPECT_EQ(error_of(std::string(kBase) + "[lora]\nalpha = 8\n"),
            "config: [lora] needs lora.rank >= 1 (0 or no [lora] section: no LoRA)");
  EXPECT_NE(error_of(with, {{"lora.alpha", "0"}}).find("lora.alpha"), std::string::npos);
  EXPECT_NE(error_of(with, {{"lora.dropout", "1"}}).find("lora.dropout"), std::string::npos);
  EXPECT_EQ(error_of(with, {{"parallel.zero", "3"}, {"parallel.offload", "cpu"}}),
            "config: lora.rank = 8 with parallel.zero = 3 and parallel.offload = \"cpu\": the "
            "frozen base of a LoRA run cannot be offloaded at ZeRO-3 yet (use parallel.offload "
            "= \"none\", or parallel.zero <= 2)");
  EXPECT_EQ(error_of(with, {{"parallel.zero", "3"}}), "");
  EXPECT_EQ(error_of(with, {{"lora.dropout", "0.1"}, {"parallel.pp", "2"}}),
            "config: lora.dropout = 0.1 with parallel.pp = 2: adapter dropout under pipeline "
            "parallelism is not implemented yet (use lora.dropout = 0)");
  EXPECT_EQ(error_of(with, {{"parallel.zero", "2"}, {"parallel.offload", "cpu"}}), "");
  EXPECT_NE(error_of(with, {{"lora.targets", "lm_head"}}).find("lora.targets"), std::string::npos);
}

// [moe]: parsed, saved and read back; bad values refused with one line naming the key.
TEST(Config, MoeKeysParsedSavedAndNamedWhenInvalid) {
  TrainConfig off = parse_config(kBase, "run.toml");
  EXPECT_FALSE(off.model.moe.enabled());
  EXPECT_EQ(config_to_toml(off).find("[moe]"), std::string::npos) << "no section when dense";
  const std::string with = std::string(kBase) +
                           "[moe]\nexperts = 8\ntop_k = 2\nhidden_dim = 32\nscore = \"sigmoid\"\n"
                           "n_groups = 4\ntopk_groups = 2\nshared_hidden = 16\naux_loss = 0.01\n";
  TrainConfig c = parse_config(with, "run.toml");
  EXPECT_EQ(c.model.moe.experts, 8);
  EXPECT_EQ(c.model.moe.score, ops::RouterScore::sigmoid);
  for (const TrainConfig& back :
       {parse_config(config_to_toml(c), "saved.toml"), config_from_json(config_to_json(c))}) {
    EXPECT_EQ(back.model.moe, c.model.moe);
  }
  EXPECT_EQ(error_of(with, {{"moe.top_k", "9"}}),
            "config: moe.top_k: must be in [1, experts = 8], got 9");
  EXPECT_EQ(error_of(with, {{"moe.score", "relu"}}),
            "moe.score: unknown router score \"relu\" (softmax, sigmoid)");
  EXPECT_NE(error_of(with, {{"moe.n_groups", "3"}}).find("moe.n_groups"), std::string::npos);
  EXPECT_NE(error_of(with, {{"moe.topk_groups", "5"}}).find("moe.topk_groups"), std::string::npos);
  EXPECT_NE(error_of(with, {{"moe.hidden_dim", "0"}}).find("moe.hidden_dim"), std::string::npos);
  EXPECT_NE(error_of(with, {{"moe.aux_loss", "-1"}}).find("moe.aux_loss"), std::string::npos);
  EXPECT_NE(error_of(with, {{"moe.first_dense", "99"}}).find("moe.first_dense"), std::string::npos);
  EXPECT_NE(error_of(with, {{"moe.shared_hidden", "0"}, {"moe.shared_gate", "true"}})
                .find("moe.shared_gate"),
            std::string::npos);
  EXPECT_EQ(parse_config(with, "run.toml", {{"parallel.tp", "2"}}).parallel.tp, 2);
  EXPECT_NE(error_of(with, {{"lora.rank", "4"}}).find("LoRA on a mixture of experts"),
            std::string::npos);
  EXPECT_NE(error_of(with, {{"model.preset", "gpt2-124M"}}).find("moe: gpt2"), std::string::npos);
  // The load-balancing statistic's scope: saved, and refused by name.
  const TrainConfig scoped = parse_config(with, "run.toml", {{"moe.aux_scope", "step"}});
  EXPECT_TRUE(scoped.model.moe.aux_per_step);
  EXPECT_TRUE(parse_config(config_to_toml(scoped), "saved.toml").model.moe.aux_per_step);
  EXPECT_EQ(error_of(with, {{"moe.aux_scope", "batch"}}),
            "config: moe.aux_scope must be \"micro_batch\" or \"step\", got \"batch\"");
  EXPECT_NE(error_of(with, {{"moe.aux_scope", "step"}, {"moe.aux_loss", "0"}})
                .find("moe.aux_scope: \"step\""),
            std::string::npos);
  // Expert parallelism: saved, and refused by name where it cannot apply.
  TrainConfig ep = parse_config(with, "run.toml", {{"parallel.ep", "4"}});
  EXPECT_EQ(parse_config(config_to_toml(ep), "saved.toml").parallel.ep, 4);
  EXPECT_EQ(error_of(with, {{"parallel.ep", "3"}}),
            "config: parallel.ep = 3 does not divide moe.experts = 8");
  EXPECT_EQ(error_of(kBase, {{"parallel.ep", "2"}}),
            "config: parallel.ep = 2 needs a mixture-of-experts model (moe.experts > 0)");
  EXPECT_NE(error_of(with, {{"parallel.ep", "0"}}).find("parallel.ep"), std::string::npos);
}

// Context parallelism: saved with the run, and refused by name where it cannot apply.
TEST(Config, ContextParallelKeysSavedAndNamedWhenInvalid) {
  const TrainConfig c = parse_config(kBase, "run.toml", {{"parallel.cp", "2"}, {"parallel.cp_comm", "ring"}});
  const TrainConfig back = parse_config(config_to_toml(c), "saved.toml");
  EXPECT_EQ(back.parallel.cp, 2);
  EXPECT_EQ(back.parallel.cp_comm, "ring");
  EXPECT_EQ(error_of(kBase, {{"parallel.cp_comm", "ulysses"}}),
            "config: parallel.cp_comm must be \"allgather\", \"ring\" or \"alltoall\", got "
            "\"ulysses\"");
  // Ulysses splits each tp rank's heads over the cp ranks (llama-tiny: 4 heads, 2 kv heads).
  EXPECT_EQ(parse_config(kBase, "run.toml", {{"parallel.cp", "2"}, {"parallel.cp_comm", "alltoall"}})
                .parallel.cp_comm,
            "alltoall");
  EXPECT_EQ(error_of(kBase, {{"parallel.cp", "4"}, {"parallel.cp_comm", "alltoall"}}),
            "config: parallel.cp_comm = \"alltoall\" splits the heads over tp x cp = 4: "
            "model.n_heads = 4 and model.n_kv_heads = 2 must divide by it");
  EXPECT_EQ(error_of(kBase, {{"parallel.cp", "3"}}),
            "config: train.seq_len = 32 is not divisible by 2 x parallel.cp = 6 (each sequence is "
            "cut into 2 x cp chunks)");
  EXPECT_NE(error_of(kBase, {{"parallel.cp", "0"}}).find("parallel.cp"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"parallel.cp", "2"}, {"moe.experts", "4"}, {"moe.hidden_dim", "8"},
                             {"moe.capacity_factor", "1.25"}})
                .find("moe.capacity_factor = 1.25 with parallel.cp = 2"),
            std::string::npos);
}

// Today's attention options (model.head_dim, qkv_bias, qk_norm): parsed,
// saved with the run, and refused by name where they cannot apply.
TEST(Config, AttentionKeysParsedSavedAndNamedWhenInvalid) {
  const ConfigOverrides qwen = {
      {"model.head_dim", "32"}, {"model.qkv_bias", "true"}, {"model.qk_norm", "head"}};
  const TrainConfig c = parse_config(kBase, "run.toml", qwen);
  EXPECT_EQ(c.model.head_dim(), 32);
  EXPECT_TRUE(c.model.qkv_bias);
  EXPECT_EQ(c.model.qk_norm, QkNorm::head);
  for (const TrainConfig& back :
       {parse_config(config_to_toml(c), "saved.toml"), config_from_json(config_to_json(c))}) {
    EXPECT_EQ(back.model.head_dim(), 32);
    EXPECT_TRUE(back.model.qkv_bias);
    EXPECT_EQ(back.model.qk_norm, QkNorm::head);
  }
  EXPECT_EQ(error_of(kBase, {{"model.qk_norm", "layer"}}),
            "model.qk_norm: unknown QK-norm \"layer\" (none, head, full)");
  EXPECT_NE(error_of(kBase, {{"model.head_dim", "7"}}).find("model.head_dim: 7 must be even"),
            std::string::npos);
  EXPECT_NE(error_of(kBase, {{"model.head_dim", "-2"}}).find("model.head_dim"), std::string::npos);
  EXPECT_NE(error_of(kBase, {{"model.preset", "gpt2-124M"}, {"model.qk_norm", "head"}})
                .find("model.qk_norm"),
            std::string::npos);
  EXPECT_NE(error_of(kBase, {{"model.preset", "gpt2-124M"}, {"model.qkv_bias", "true"}})
                .find("model.qkv_bias"),
            std::string::npos);
  // Checked where the layout is (memory plan, model): every rank, before allocating.
  const TrainConfig olmoe = parse_config(kBase, "run.toml", {{"model.qk_norm", "full"}});
  check_tensor_parallel_split(olmoe.model, 1);
  try {
    check_tensor_parallel_split(olmoe.model, 2);
    ADD_FAILURE() << "tp 2 with QK-norm over all heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.qk_norm = \"full\""), std::string::npos);
  }
}

}  // namespace
}  // namespace meshtrain
