#include "meshtrain/data/prepare.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "meshtrain/data/token_file.h"
#include "meshtrain/util/error.h"
#include "tokenizer_test_util.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::write_file;

PrepareOptions byte_options(const std::string& input, const std::string& out) {
  PrepareOptions o;
  o.inputs = {input};
  o.output_dir = out;
  o.tokenizer = "bytes";
  o.progress = "none";
  return o;
}

std::vector<uint16_t> read_tokens(const std::vector<std::string>& files) {
  std::vector<uint16_t> all;
  for (const auto& f : files) {
    TokenFile t(f);
    for (int64_t i = 0; i < t.size(); ++i) all.push_back(static_cast<uint16_t>(t.token(i)));
  }
  return all;
}

// The documents of a byte-level stream (each starts with the NUL separator).
std::vector<std::string> split_byte_stream(const std::vector<uint16_t>& tokens) {
  std::vector<std::string> docs;
  for (uint16_t t : tokens) {
    if (t == 0) {
      docs.emplace_back();
    } else {
      EXPECT_FALSE(docs.empty()) << "stream does not start with the separator";
      if (!docs.empty()) docs.back().push_back(static_cast<char>(t));
    }
  }
  return docs;
}

// `n` documents of random printable text, as files 000.txt, 001.txt, ...
std::vector<std::string> write_corpus(const std::string& dir, int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::string> docs;
  fs::create_directories(dir);
  for (int i = 0; i < n; ++i) {
    std::string text(1 + rng() % 300, ' ');
    for (auto& c : text) c = static_cast<char>(' ' + rng() % 95);
    char name[16];
    std::snprintf(name, sizeof name, "%03d.txt", i);
    write_file(dir + "/" + name, text);
    docs.push_back(text);
  }
  return docs;
}

TEST(Prepare, WritesDocumentsInOrderEachAfterTheSeparator) {
  std::string dir = testing::scratch_dir();
  fs::create_directories(dir + "/in");
  write_file(dir + "/in/b.txt", "bb");
  write_file(dir + "/in/a.txt", "aaa");
  write_file(dir + "/in/c.txt", "c");
  write_file(dir + "/in/notes.md", "not text");
  write_file(dir + "/in/empty.txt", "");
  PrepareSummary s = prepare_corpus(byte_options(dir + "/in", dir + "/out"), nullptr);
  EXPECT_EQ(s.documents, 3);
  EXPECT_EQ(s.text_bytes, 6);
  ASSERT_EQ(s.train_files, std::vector<std::string>{dir + "/out/train_000000.bin"});
  EXPECT_TRUE(s.val_files.empty());
  EXPECT_EQ(read_tokens(s.train_files),
            (std::vector<uint16_t>{0, 'a', 'a', 'a', 0, 'b', 'b', 0, 'c'}));
}

TEST(Prepare, ShardsAndValidationSplit) {
  std::string dir = testing::scratch_dir();
  std::vector<std::string> docs = write_corpus(dir + "/in", 20, 1);
  PrepareOptions o = byte_options(dir + "/in", dir + "/out");
  o.shard_tokens = 100;
  o.val_fraction = 0.2;
  o.threads = 3;
  PrepareSummary s = prepare_corpus(o, nullptr);
  EXPECT_EQ(s.val_documents, 4);
  EXPECT_EQ(s.train_documents, 16);
  for (const auto* files : {&s.train_files, &s.val_files}) {
    ASSERT_FALSE(files->empty());
    for (size_t i = 0; i + 1 < files->size(); ++i) EXPECT_EQ(TokenFile((*files)[i]).size(), 100);
    EXPECT_LE(TokenFile(files->back()).size(), 100);
  }
  std::vector<std::string> train = split_byte_stream(read_tokens(s.train_files));
  std::vector<std::string> val = split_byte_stream(read_tokens(s.val_files));
  EXPECT_EQ(static_cast<int64_t>(read_tokens(s.train_files).size()), s.train_tokens);
  ASSERT_EQ(train.size(), 16u);
  ASSERT_EQ(val.size(), 4u);
  // Each split keeps the input order; together they are every document once.
  size_t t = 0, v = 0;
  for (const auto& d : docs) {
    if (t < train.size() && train[t] == d) {
      ++t;
    } else {
      ASSERT_LT(v, val.size());
      EXPECT_EQ(val[v++], d);
    }
  }
  EXPECT_EQ(t, train.size());
  EXPECT_EQ(v, val.size());

  // Another seed holds out other documents.
  o.seed = 99;
  o.output_dir = dir + "/out_seed99";
  PrepareSummary other = prepare_corpus(o, nullptr);
  EXPECT_NE(split_byte_stream(read_tokens(other.val_files)), val);
}

TEST(Prepare, OutputDoesNotDependOnThreads) {
  std::string dir = testing::scratch_dir();
  write_corpus(dir + "/in", 40, 2);
  std::vector<std::string> outputs;
  for (int threads : {1, 2, 5}) {
    PrepareOptions o = byte_options(dir + "/in", dir + "/out" + std::to_string(threads));
    o.shard_tokens = 777;
    o.val_fraction = 0.1;
    o.threads = threads;
    PrepareSummary s = prepare_corpus(o, nullptr);
    std::string all;
    for (const auto& f : s.train_files) all += read_file(f);
    for (const auto& f : s.val_files) {
      all += '|';
      all += read_file(f);
    }
    outputs.push_back(all);
  }
  EXPECT_EQ(outputs[0], outputs[1]);
  EXPECT_EQ(outputs[0], outputs[2]);
}

TEST(Prepare, Gpt2DocumentsAreEotThenTheirIds) {
  MESHTRAIN_NEED_GPT2_RANKS();
  std::string dir = testing::scratch_dir();
  write_file(dir + "/corpus.txt", "In the beginning.\n@@\nAnd the earth was without form.\n");
  PrepareOptions o;
  o.inputs = {dir + "/corpus.txt"};
  o.output_dir = dir + "/out";
  o.gpt2_ranks = testing::gpt2_ranks_path();
  o.separator = "\n@@\n";
  o.threads = 2;
  o.progress = "none";
  PrepareSummary s = prepare_corpus(o, nullptr);
  EXPECT_EQ(s.documents, 2);
  auto tok = make_tokenizer("gpt2", o.gpt2_ranks);
  std::vector<uint16_t> expected;
  for (std::string doc : {"In the beginning.", "And the earth was without form.\n"}) {
    expected.push_back(50256);
    for (int32_t id : tok->encode_ordinary(doc)) expected.push_back(static_cast<uint16_t>(id));
  }
  EXPECT_EQ(read_tokens(s.train_files), expected);
}

TEST(Prepare, SeparatorDropsEmptyDocumentsAndRerunsRemoveStaleShards) {
  std::string dir = testing::scratch_dir();
  write_file(dir + "/all.txt", "one<SEP>two<SEP><SEP>three<SEP>");
  PrepareOptions o = byte_options(dir + "/all.txt", dir + "/out");
  o.separator = "<SEP>";
  o.shard_tokens = 4;
  PrepareSummary s = prepare_corpus(o, nullptr);
  EXPECT_EQ(s.documents, 3);
  EXPECT_EQ(s.train_tokens, 3 + 11);
  ASSERT_EQ(s.train_files.size(), 4u);
  EXPECT_EQ(split_byte_stream(read_tokens(s.train_files)),
            (std::vector<std::string>{"one", "two", "three"}));
  o.shard_tokens = 1000;
  s = prepare_corpus(o, nullptr);
  EXPECT_EQ(s.train_files.size(), 1u);
  EXPECT_FALSE(fs::exists(dir + "/out/train_000001.bin"));
  EXPECT_TRUE(fs::exists(dir + "/out/train_000000.bin"));
}

TEST(Prepare, BarProgressEndsAtOneHundredPercent) {
  std::string dir = testing::scratch_dir();
  write_corpus(dir + "/in", 3, 3);
  PrepareOptions o = byte_options(dir + "/in", dir + "/out");
  o.progress = "bar";
  std::FILE* log = std::tmpfile();
  ASSERT_NE(log, nullptr);
  prepare_corpus(o, log);
  std::rewind(log);
  std::string text(4096, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), log));
  std::fclose(log);
  EXPECT_NE(text.find("100.0%"), std::string::npos) << text;
  EXPECT_NE(text.find("ETA"), std::string::npos) << text;
}

void expect_error(const PrepareOptions& o, const std::string& part) {
  try {
    prepare_corpus(o, nullptr);
    ADD_FAILURE() << "no error; expected one with '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(Prepare, BadOptionsAndInputsFailClearly) {
  std::string dir = testing::scratch_dir();
  write_corpus(dir + "/in", 2, 4);
  fs::create_directories(dir + "/no_txt");
  write_file(dir + "/no_txt/readme.md", "x");
  PrepareOptions o = byte_options(dir + "/in", dir + "/out");
  auto with = [&](auto change) {
    PrepareOptions copy = o;
    change(copy);
    return copy;
  };
  expect_error(with([](auto& c) { c.inputs.clear(); }), "no input");
  expect_error(with([&](auto& c) { c.inputs = {dir + "/missing.txt"}; }), dir + "/missing.txt");
  expect_error(with([&](auto& c) { c.inputs = {dir + "/no_txt"}; }), "has no .txt files");
  expect_error(with([](auto& c) { c.output_dir.clear(); }), "no output directory");
  expect_error(with([](auto& c) { c.shard_tokens = 0; }), "shard_tokens 0");
  expect_error(with([](auto& c) { c.val_fraction = 1.0; }), "val_fraction 1");
  expect_error(with([](auto& c) { c.val_fraction = 0.9; }), "leaves no training document");
  expect_error(with([](auto& c) { c.tokenizer = "words"; }), "tokenizer 'words'");
  expect_error(with([](auto& c) { c.progress = "fancy"; }), "progress 'fancy'");
  expect_error(with([&](auto& c) {
                 c.tokenizer = "gpt2";
                 c.gpt2_ranks = dir + "/none.tiktoken";
               }),
               dir + "/none.tiktoken");
}

}  // namespace
}  // namespace meshtrain
