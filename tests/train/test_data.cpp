// Token files (every header check), the dataset's windows and the keyed
// permutation (the loader's order: tests/data/loader_test.cpp).
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "meshtrain/data/sampler.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/util/error.h"
#include "support/scratch.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

class TokenFileTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::scratch_dir(); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A raw file: header fields and token bytes as given.
  std::string raw(const std::string& name, int32_t magic, int32_t version, int32_t count,
                  const std::vector<uint16_t>& tokens, size_t header_bytes = 1024) {
    std::array<int32_t, 256> header{};
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    std::ofstream out(path(name), std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header_bytes));
    out.write(reinterpret_cast<const char*>(tokens.data()),
              static_cast<std::streamsize>(tokens.size() * 2));
    return path(name);
  }

  // The Error of opening `p` (with vocab), or "".
  static std::string error_of(const std::string& p, int64_t vocab = 0) {
    try {
      TokenFile f(p, vocab);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(TokenFileTest, WriteThenRead) {
  std::vector<uint16_t> tokens = {0, 1, 2, 65535, 7};
  write_token_file(path("a.bin"), tokens);
  TokenFile f(path("a.bin"));
  ASSERT_EQ(f.size(), 5);
  std::vector<int32_t> back(5);
  f.read(0, 5, back.data());
  EXPECT_EQ(back, std::vector<int32_t>(tokens.begin(), tokens.end()));
  EXPECT_EQ(fs::file_size(path("a.bin")), 1024u + 10u);
  TokenFile moved = std::move(f);
  EXPECT_EQ(moved.token(3), 65535);
}

// Version 2: uint32 ids for vocabularies past 65536 (Llama 3, Qwen).
TEST_F(TokenFileTest, WideIdsPastSixtyFiveThousand) {
  std::vector<uint32_t> tokens = {0, 65536, 151643, 7};
  write_token_file(path("wide.bin"), tokens);
  EXPECT_EQ(fs::file_size(path("wide.bin")), 1024u + 16u);
  TokenFile f(path("wide.bin"), 151646);
  EXPECT_EQ(f.bytes_per_token(), 4);
  std::vector<int32_t> back(3);
  f.read(1, 3, back.data());
  EXPECT_EQ(back, (std::vector<int32_t>{65536, 151643, 7}));
  EXPECT_THROW(TokenFile(path("wide.bin"), 151643), Error);  // id 151643 is past the vocabulary
}

TEST_F(TokenFileTest, EveryHeaderProblemIsOneLineNamingTheFile) {
  std::vector<uint16_t> tokens = {1, 2, 3, 4};
  std::string p = raw("magic.bin", 12345, 1, 4, tokens);
  EXPECT_EQ(error_of(p), "data file '" + p + "': bad magic 12345 (expected 20240520: an llm.c token file)");
  p = raw("version.bin", kTokenFileMagic, 3, 4, tokens);
  EXPECT_EQ(error_of(p), "data file '" + p + "': unsupported version 3 (expected 1: uint16 tokens, or 2: uint32)");
  p = raw("short_header.bin", kTokenFileMagic, 1, 4, {}, 100);
  EXPECT_EQ(error_of(p), "data file '" + p + "': truncated: 100 bytes, shorter than the 1024-byte header");
  p = raw("short_body.bin", kTokenFileMagic, 1, 10, tokens);
  EXPECT_EQ(error_of(p), "data file '" + p +
                             "': truncated: header says 10 tokens (1044 bytes), file has 1032 bytes");
  p = raw("long_body.bin", kTokenFileMagic, 1, 2, tokens);
  EXPECT_EQ(error_of(p), "data file '" + p + "': 4 bytes after the 2 tokens the header announces");
  p = raw("negative.bin", kTokenFileMagic, 1, -1, tokens);
  EXPECT_EQ(error_of(p), "data file '" + p + "': negative token count -1");
  p = raw("vocab.bin", kTokenFileMagic, 1, 4, {1, 2, 256, 3});
  EXPECT_EQ(error_of(p, 256), "data file '" + p + "': token 2 has id 256, not below the vocabulary size 256");
  EXPECT_EQ(error_of(p, 257), "");
  EXPECT_EQ(error_of(path("missing.bin")).rfind("data file '" + path("missing.bin") + "': cannot open", 0), 0u);
  for (const char* name : {"magic.bin", "version.bin", "short_body.bin", "vocab.bin"}) {
    EXPECT_EQ(error_of(path(name), 256).find('\n'), std::string::npos);
  }
}

TEST_F(TokenFileTest, DatasetWindowsAcrossFiles) {
  std::vector<uint16_t> a(23), b(9);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint16_t>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(100 + i);
  write_token_file(path("a.bin"), a);
  write_token_file(path("b.bin"), b);
  TokenDataset data({path("a.bin"), path("b.bin")}, 200, 4);
  // a: windows at 0, 4, ..., 16 (16 + 5 <= 23) -> 5; b: at 0, 4 -> 2.
  ASSERT_EQ(data.num_samples(), 7);
  std::vector<int32_t> in(4), tg(4);
  data.read_sample(4, in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int32_t>{16, 17, 18, 19}));
  EXPECT_EQ(tg, (std::vector<int32_t>{17, 18, 19, 20}));
  data.read_sample(6, in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int32_t>{104, 105, 106, 107}));
  EXPECT_EQ(tg, (std::vector<int32_t>{105, 106, 107, 108}));
  EXPECT_THROW(data.read_sample(7, in.data(), tg.data()), Error);
  EXPECT_EQ(TokenDataset({path("b.bin")}, 200, 8).num_samples(), 1);  // exactly 8+1 tokens
  EXPECT_THROW(TokenDataset({path("b.bin")}, 200, 9), Error);  // 9 tokens: no window of 9+1
  EXPECT_THROW(TokenDataset({path("b.bin")}, 100, 2), Error);  // ids >= vocab
}

TEST(KeyedPermutation, IsABijection) {
  for (uint64_t n : {1ull, 2ull, 3ull, 7ull, 64ull, 1000ull, 4097ull}) {
    KeyedPermutation perm(n, 12345);
    std::set<uint64_t> seen;
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t j = perm(i);
      ASSERT_LT(j, n);
      seen.insert(j);
    }
    EXPECT_EQ(seen.size(), n) << n;
  }
  // Shuffled, and keyed.
  KeyedPermutation a(1000, 1), b(1000, 2);
  int fixed = 0, same = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    fixed += a(i) == i;
    same += a(i) == b(i);
  }
  EXPECT_LT(fixed, 20);
  EXPECT_LT(same, 20);
}

}  // namespace
}  // namespace meshtrain
