// Supervised fine-tuning: the record template and its loss mask, bad records
// named by file, line and field, packing, and whole runs (normalisation over
// the step's loss tokens: micro-batches equal one big batch; resume bit-exact;
// train.init_from a Hugging Face directory).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/data/sft.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/util/error.h"
#include "data/tokenizer_test_util.h"
#include "support/hf_logits.h"
#include "support/scratch.h"
#include "support/sft_run.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = testing::sft_fixtures_dir();

std::vector<int32_t> bytes_of(const std::string& s) { return ByteTokenizer().encode_ordinary(s); }

TEST(SftRecord, TemplateAndLossMaskAreAsDocumented) {
  const ByteTokenizer bytes;
  const SftRecord r = tokenize_sft_record(R"({"prompt": "hi", "response": "yo"})", bytes, "x:1");
  std::vector<int32_t> want = {0};
  std::vector<uint8_t> loss = {0};
  for (int32_t id : bytes_of("User: hi\nAssistant: ")) want.push_back(id), loss.push_back(0);
  for (int32_t id : bytes_of("yo")) want.push_back(id), loss.push_back(1);
  want.push_back(0), loss.push_back(1);  // eos closes the response, in the loss
  EXPECT_EQ(r.tokens, want);
  EXPECT_EQ(r.in_loss, loss);

  // Chat: system and user turns are context; each assistant turn learns.
  const SftRecord c = tokenize_sft_record(
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"},
          {"role": "assistant", "content": "b"}]})",
      bytes, "x:2");
  std::string text;
  for (int32_t id : c.tokens) text += static_cast<char>(id);
  const char want_text[] = "\0System: s\nUser: u\nAssistant: a\0User: v\nAssistant: b\0";
  EXPECT_EQ(text, std::string(want_text, sizeof(want_text) - 1));
  std::string learned;
  for (size_t i = 0; i < c.tokens.size(); ++i)
    if (c.in_loss[i]) learned += c.tokens[i] == 0 ? '$' : static_cast<char>(c.tokens[i]);
  EXPECT_EQ(learned, "a$b$");
}

// GPT-2 BPE: E = <|endoftext|> (50256) opens the record and closes the response;
// each piece is encoded on its own.
TEST(SftRecord, Gpt2TemplateUsesEndOfText) {
  MESHTRAIN_NEED_GPT2_RANKS();
  const std::unique_ptr<Tokenizer> gpt2 = make_tokenizer("gpt2", testing::gpt2_ranks_path());
  const SftRecord r = tokenize_sft_record(R"({"prompt": "Hi there", "response": "Hello!"})", *gpt2, "x:1");
  std::vector<int32_t> want = {50256};
  for (const char* piece : {"User: ", "Hi there", "\n", "Assistant: ", "Hello!"}) {
    const std::vector<int32_t> ids = gpt2->encode_ordinary(piece);
    want.insert(want.end(), ids.begin(), ids.end());
  }
  want.push_back(50256);
  EXPECT_EQ(r.tokens, want);
  const size_t response = gpt2->encode_ordinary("Hello!").size() + 1;
  for (size_t i = 0; i < r.tokens.size(); ++i) EXPECT_EQ(r.in_loss[i], i + response >= r.tokens.size()) << i;
}

std::string error_of(const std::string& line, ErrorKind* kind = nullptr) {
  try {
    tokenize_sft_record(line, ByteTokenizer(), "f.jsonl:7");
  } catch (const Error& e) {
    if (kind) *kind = e.kind();
    return e.what();
  }
  return "";
}

TEST(SftRecord, BadRecordsNameFileLineAndField) {
  ErrorKind kind = ErrorKind::io;
  EXPECT_NE(error_of(R"({"prompt": "a"})", &kind).find("f.jsonl:7: field 'response' missing"),
            std::string::npos);
  EXPECT_EQ(kind, ErrorKind::config);
  EXPECT_NE(error_of(R"({"prompt": 3, "response": "b"})").find("field 'prompt' must be a string"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "a", "response": )", &kind).find("f.jsonl:7: not a JSON record"),
            std::string::npos);
  EXPECT_EQ(kind, ErrorKind::corrupt);
  EXPECT_NE(error_of(R"({"messages": [{"role": "bot", "content": "x"}]})")
                .find("messages[0]: field 'role' is 'bot'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"role": "user", "content": "x"}]})").find("no assistant turn"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"text": "x"})").find("needs 'prompt' and 'response' or 'messages'"),
            std::string::npos);

  // In a file: its path and 1-based line (blank lines counted, skipped).
  const fs::path dir = testing::scratch_dir();
  const std::string path = (dir / "bad.jsonl").string();
  std::ofstream(path) << R"({"prompt": "a", "response": "b"})" << "\n\n" << R"({"prompt": "a"})" << "\n";
  try {
    SftDataset data({path}, ByteTokenizer(), SftOptions{.seq_len = 64});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ":3: field 'response' missing"), std::string::npos)
        << e.what();
  }
}

TEST(SftDataset, PackingKeepsEveryRecordOnceAndCountsLossTokens) {
  const ByteTokenizer bytes;
  const std::string file = kFixtures + "/sft_tiny.jsonl";
  SftOptions o{.seq_len = 128, .pack = true, .truncate = true, .shuffle = true, .seed = 3};
  const SftDataset packed({file}, bytes, o);
  o.pack = false;
  const SftDataset unpacked({file}, bytes, o);
  EXPECT_EQ(packed.num_records(), 27);
  EXPECT_EQ(unpacked.num_samples(), 27);
  EXPECT_LT(packed.num_samples(), unpacked.num_samples());
  EXPECT_EQ(packed.total_loss_tokens(), unpacked.total_loss_tokens());
  EXPECT_GT(packed.packing_efficiency(), unpacked.packing_efficiency());
  EXPECT_FALSE(unpacked.has_positions());
  ASSERT_TRUE(packed.has_positions());
  // Rows: positions restart at 0 per record; counted targets = loss_tokens;
  // the record starts (position 0) are as many as records (+ padding runs).
  int64_t starts = 0, padding_runs = 0, loss = 0;
  std::vector<int32_t> in(128), tg(128), pos(128);
  for (int64_t s = 0; s < packed.num_samples(); ++s) {
    packed.read_sample(s, in.data(), tg.data());
    packed.read_positions(s, pos.data());
    int64_t counted = 0;
    for (int64_t t = 0; t < 128; ++t) {
      ASSERT_TRUE(pos[t] == 0 || (t > 0 && pos[t] == pos[t - 1] + 1));
      counted += tg[t] >= 0;
      if (pos[t] == 0) ++starts;
      // A padding run: input eos with no target, to the end of the row.
      if (pos[t] == 0 && tg[t] < 0 && in[t] == 0 && t > 0 &&
          std::all_of(tg.begin() + t, tg.end(), [](int32_t x) { return x < 0; }))
        ++padding_runs;
    }
    EXPECT_EQ(counted, packed.loss_tokens(s));
    loss += counted;
  }
  EXPECT_EQ(loss, packed.total_loss_tokens());
  EXPECT_GE(starts, 27);
  EXPECT_LE(starts, 27 + padding_runs);

  // Longer than seq_len: refused by data.sft_overflow = "refuse", naming the line.
  o.truncate = false;
  o.seq_len = 32;
  try {
    SftDataset refused({file}, bytes, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sft_tiny.jsonl:1: record of"), std::string::npos) << e.what();
  }
  o.truncate = true;
  EXPECT_EQ(SftDataset({file}, bytes, o).truncated_records(), 27);
}

TEST(SftConfig, SftKeysWithTokenShardsAreRefused) {
  auto parse = [](ConfigOverrides o) { return testing::sft_run_config("out", std::move(o)); };
  EXPECT_NO_THROW(parse({{"data.sft_pack", "false"}}));
  EXPECT_NO_THROW(parse({{"data.format", "tokens"}}));
  try {
    parse({{"data.format", "tokens"}, {"data.sft_pack", "false"}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "config: data.sft_pack applies to data.format = \"sft-jsonl\", "
                           "\"chat-jsonl\" or \"preference-jsonl\" only (this run reads \"tokens\")");
  }
  try {
    parse({{"data.format", "jsonl"}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "data.format must be \"tokens\", \"sft-jsonl\", \"chat-jsonl\" or "
                  "\"preference-jsonl\", got \"jsonl\""),
              std::string::npos);
  }
}

class SftTrainer : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::scratch_dir(); }

  TrainConfig config(const std::string& out, ConfigOverrides o = {}) const {
    o.insert(o.begin(), {{"train.eval_interval", "2"}, {"train.checkpoint_interval", "2"}});
    return testing::sft_run_config((dir_ / out).string(), o);
  }
  fs::path dir_;
};

// The loss is the mean over the step's loss tokens: 4 micro-batches of 1 row
// equal one of 4 (rows hold different numbers of loss tokens, so a per-micro-
// batch mean would differ), packed and unpacked, llama and gpt2.
TEST_F(SftTrainer, MicroBatchesEqualOneBatchOverLossTokens) {
  for (const char* pack : {"true", "false"}) {
    for (const char* family : {"llama", "gpt2"}) {
      SCOPED_TRACE(std::string(pack) + " " + family);
      ConfigOverrides o = {{"data.sft_pack", pack}, {"model.family", family}};
      if (std::string(family) == "gpt2") o.push_back({"model.n_kv_heads", "4"});
      const auto one = testing::run_trainer(config(std::string("one_") + pack + family, o));
      o.push_back({"train.micro_batch_size", "1"});
      const auto four = testing::run_trainer(config(std::string("four_") + pack + family, o));
      ASSERT_EQ(one.records.size(), four.records.size());
      for (size_t i = 0; i < one.records.size(); ++i) {
        EXPECT_GT(one.records[i].loss_tokens, 0);
        EXPECT_LT(one.records[i].loss_tokens, 4 * 128);
        EXPECT_EQ(one.records[i].loss_tokens, four.records[i].loss_tokens);
        EXPECT_NEAR(one.records[i].loss, four.records[i].loss, 1e-5 * one.records[i].loss) << i;
      }
      for (size_t i = 0; i < one.weights.size(); ++i)
        ASSERT_NEAR(one.weights[i], four.weights[i], 1e-5) << i;
    }
  }
}

TEST_F(SftTrainer, ResumeEqualsTheUninterruptedRunBitForBit) {
  const auto full = testing::run_trainer(config("full"));
  const auto resumed = testing::run_trainer(config("resumed"), nullptr, (dir_ / "full/step_2").string());
  ASSERT_EQ(resumed.records.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed.records[i].loss, full.records[2 + i].loss);
  ASSERT_EQ(0, std::memcmp(resumed.weights.data(), full.weights.data(),
                           full.weights.size() * sizeof(float)));
}

// meshtrain eval of an SFT run's checkpoint on its validation JSONL: the
// run's data settings, so its logged val_loss (over loss tokens) comes back.
TEST_F(SftTrainer, EvalOfTheCheckpointReproducesItsValidationLoss) {
  const auto run = testing::run_trainer(config("evaluated", {{"train.steps", "2"}}), nullptr, "", true);
  EvalOptions options;
  options.data = {kFixtures + "/sft_tiny_val.jsonl"};
  options.threads = 2;
  const EvalResult r = evaluate_checkpoint((dir_ / "evaluated/step_2").string(), options, nullptr);
  EXPECT_NEAR(r.loss, run.val_loss, 1e-6 * run.val_loss);
  EXPECT_LT(r.tokens, r.batch_size * r.seq_len);  // loss tokens only
}

// train.init_from a training checkpoint (the sharded format): its master
// weights at step 0 and a new run (steps from 1, data from the start); its
// resume continues it bit for bit.
TEST_F(SftTrainer, InitFromATrainingCheckpointTakesItsWeightsOnly) {
  const auto source = testing::run_trainer(config("source", {{"train.steps", "2"}}));
  const std::string step = (dir_ / "source/step_2").string();
  TrainConfig c = config("init", {{"train.init_from", step}});
  TrainerOptions options;
  options.console = false;
  Trainer trainer(c, options);
  const std::vector<float> start = trainer.gather_weights();
  ASSERT_EQ(0, std::memcmp(start.data(), source.weights.data(), start.size() * sizeof(float)));
  const auto records = trainer.run();
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records.front().step, 1);  // step 0: a new run, not a resume
  // Resuming that run resumes (its checkpoint), it does not initialise again.
  const auto resumed = testing::run_trainer(config("init_resumed", {{"train.init_from", step}}),
                                            nullptr, (dir_ / "init/step_2").string());
  ASSERT_EQ(resumed.records.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed.records[i].loss, records[2 + i].loss);
  const std::vector<float> end = trainer.gather_weights();
  EXPECT_EQ(0, std::memcmp(resumed.weights.data(), end.data(), end.size() * sizeof(float)));
}

// train.init_from a transformers-written directory: the model comes from its
// config.json, the weights are HF's at step 0 (so are the logits:
// tests/ckpt/test_hf_transformers.cpp), the optimizer is fresh; a [model] key
// that disagrees is refused by name.
TEST_F(SftTrainer, InitFromHuggingFaceStartsFromItsWeights) {
  const std::string hf = std::string(MESHTRAIN_SOURCE_DIR) +
                         "/tests/reference/fixtures/hf_tiny_llama_theta1e4_gqa_untied";
  testing::write_phrase_corpus(dir_.string(), 64);
  const std::string toml = R"(
[train]
steps = 1
batch_size = 2
seq_len = 16
threads = 2
eval_interval = 0
peak_flops = 1e11
init_from = ")" + hf + R"("
[data]
)";
  TrainConfig c = testing::tiny_run_config(toml, dir_.string(), "init", {}, "init.toml");
  TrainerOptions options;
  options.console = false;
  {
    Trainer trainer(c, options);
    EXPECT_EQ(trainer.config().model.dim, 32);
    EXPECT_EQ(trainer.config().model.vocab_size, 64);
    const std::vector<float> weights = trainer.gather_weights();
    MemoryTracker tracker;
    cpu::CpuBackend ctx(2, tracker);
    const std::unique_ptr<Model> want = import_hf(hf, Precision::fp32, ctx);
    ASSERT_EQ(weights.size(), static_cast<size_t>(want->num_params()));
    EXPECT_EQ(0, std::memcmp(weights.data(), want->flat_master().data<float>(),
                             weights.size() * sizeof(float)));
    // Those weights give transformers' logits (the fixture's ids, as test_hf_transformers).
    Model start(trainer.config().model, Precision::fp32, ctx);
    std::copy(weights.begin(), weights.end(), start.flat_master().data<float>());
    EXPECT_LE(testing::hf_logits_error(start, hf), 1e-5);
    const auto records = trainer.run();
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].step, 1);
  }
  try {
    TrainConfig bad = testing::tiny_run_config("[model]\nn_layers = 3\n" + toml, dir_.string(), "bad",
                                               {}, "bad.toml");
    Trainer trainer(bad, options);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_layers = 3 disagrees with train.init_from"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace meshtrain
