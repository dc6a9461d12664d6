// Tokenizer files written beside exports: llama2.c's tokenizer.bin gives every
// id back, and HF's tokenizer.json holds the vocabulary, merges and special ids.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "data/tokenizer_test_util.h"
#include "meshtrain/ckpt/tokenizer_files.h"
#include "meshtrain/data/bpe_tokenizer.h"
#include "util.h"

namespace meshtrain {
namespace {

using TokenizerFiles = ckpt_test::CkptTest;

void expect_llama2c_round_trip(const Tokenizer& t, int64_t vocab, const std::string& path) {
  write_llama2c_tokenizer(t, vocab, path);
  const std::vector<Llama2cToken> back = read_llama2c_tokenizer(path, vocab);
  ASSERT_EQ(static_cast<int64_t>(back.size()), vocab);
  for (int32_t id = 0; id < vocab; ++id) {
    const int32_t ids[] = {id};
    const std::string want = id < t.vocab_size() ? t.decode(ids) : std::string();
    ASSERT_EQ(back[static_cast<size_t>(id)].bytes, want) << "id " << id;
  }
}

TEST_F(TokenizerFiles, Llama2cTokenizerBinGivesEveryIdBack) {
  ByteTokenizer bytes;
  expect_llama2c_round_trip(bytes, 300, dir + "/tokenizer.bin");  // 44 padding ids
  EXPECT_ERROR(write_llama2c_tokenizer(bytes, 100, dir + "/small.bin"), "small.bin",
               "smaller than tokenizer 'bytes'");
  testing::write_file(dir + "/short.bin", std::string(12, '\0'));
  EXPECT_ERROR(read_llama2c_tokenizer(dir + "/short.bin", 5), "short.bin", "cannot hold 5 tokens");
  // Room for five tokens by count, but the first claims 100 bytes (max_token_length 100).
  std::string cut(44, '\0');
  const int32_t length = 100;
  cut.replace(0, 4, reinterpret_cast<const char*>(&length), 4);
  cut.replace(8, 4, reinterpret_cast<const char*>(&length), 4);
  testing::write_file(dir + "/cut.bin", cut);
  EXPECT_ERROR(read_llama2c_tokenizer(dir + "/cut.bin", 5), "cut.bin", "ends inside token 0");
}

TEST_F(TokenizerFiles, LlmcTokenizerBinGivesEveryIdBack) {
  ByteTokenizer bytes;
  write_llmc_tokenizer(bytes, dir + "/gpt2_tokenizer.bin");
  int32_t eot = -1;
  const std::vector<std::string> back = read_llmc_tokenizer(dir + "/gpt2_tokenizer.bin", &eot);
  ASSERT_EQ(back.size(), 256u);
  EXPECT_EQ(eot, 0);
  for (int32_t id = 0; id < 256; ++id) ASSERT_EQ(back[static_cast<size_t>(id)], std::string(1, static_cast<char>(id)));
  testing::write_file(dir + "/bad.bin", std::string(1024, '\0'));
  EXPECT_ERROR(read_llmc_tokenizer(dir + "/bad.bin"), "bad.bin", "bad magic 0");
}

TEST_F(TokenizerFiles, Gpt2LlmcTokenizerBinIsLlmcsGpt2File) {
  MESHTRAIN_NEED_GPT2_RANKS();
  auto gpt2 = BpeTokenizer::load(testing::gpt2_ranks_path());
  write_llmc_tokenizer(*gpt2, dir + "/gpt2_tokenizer.bin");
  int32_t eot = -1;
  const std::vector<std::string> back = read_llmc_tokenizer(dir + "/gpt2_tokenizer.bin", &eot);
  ASSERT_EQ(back.size(), 50257u);
  EXPECT_EQ(eot, 50256);
  for (int32_t id = 0; id < 50257; ++id) {
    const int32_t ids[] = {id};
    ASSERT_EQ(back[static_cast<size_t>(id)], gpt2->decode(ids)) << "id " << id;
  }
}

TEST_F(TokenizerFiles, Gpt2Llama2cTokenizerBinGivesEveryIdBack) {
  MESHTRAIN_NEED_GPT2_RANKS();
  auto gpt2 = BpeTokenizer::load(testing::gpt2_ranks_path());
  expect_llama2c_round_trip(*gpt2, 50304, dir + "/tokenizer.bin");
  const std::vector<Llama2cToken> back = read_llama2c_tokenizer(dir + "/tokenizer.bin", 50304);
  EXPECT_EQ(back[50256].bytes, "<|endoftext|>");
  EXPECT_EQ(back[1000].score, -1000.0f);  // merged first = lowest rank = highest score
}

TEST_F(TokenizerFiles, HfTokenizerJsonOfGpt2HasItsVocabularyAndMerges) {
  MESHTRAIN_NEED_GPT2_RANKS();
  auto gpt2 = BpeTokenizer::load(testing::gpt2_ranks_path());
  const auto j = nlohmann::json::parse(hf_tokenizer_json(*gpt2));
  EXPECT_EQ(j["model"]["type"], "BPE");
  EXPECT_EQ(j["model"]["vocab"].size(), 50257u);
  EXPECT_EQ(j["model"]["vocab"]["<|endoftext|>"], 50256);
  EXPECT_EQ(j["model"]["vocab"]["Ġthe"], 262);  // " the": space is Ġ in ByteLevel's alphabet
  EXPECT_EQ(j["model"]["merges"].size(), 50000u);  // GPT-2's merges.txt has 50000
  EXPECT_EQ(j["model"]["merges"][0], "Ġ t");
  EXPECT_EQ(j["added_tokens"][0]["id"], 50256);
  const auto config = nlohmann::json::parse(hf_tokenizer_config_json(*gpt2, 1024));
  EXPECT_EQ(config["eos_token"], "<|endoftext|>");
  const auto generation = nlohmann::json::parse(hf_generation_config_json(*gpt2));
  EXPECT_EQ(generation["bos_token_id"], 50256);
  EXPECT_EQ(generation["eos_token_id"], 50256);
}

TEST_F(TokenizerFiles, HfTokenizerJsonOfBytesIsByteLevel) {
  ByteTokenizer bytes;
  const auto j = nlohmann::json::parse(hf_tokenizer_json(bytes));
  EXPECT_EQ(j["model"]["vocab"].size(), 256u);
  EXPECT_EQ(j["model"]["vocab"]["A"], 65);
  EXPECT_EQ(j["model"]["vocab"]["Ġ"], 32);
  EXPECT_EQ(j["model"]["vocab"]["Ā"], 0);
  EXPECT_TRUE(j["model"]["merges"].empty());
  EXPECT_EQ(nlohmann::json::parse(hf_generation_config_json(bytes))["eos_token_id"], 0);
}

}  // namespace
}  // namespace meshtrain
