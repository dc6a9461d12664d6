// Token ids from BpeTokenizer against PyPI's tiktoken (tests/tokenizer/
// tiktoken_ref.py) on whole files. Runs under ctest's tokenizer.tiktoken_parity,
// which fetches the ranks and the KJV text first and sets
// MESHTRAIN_TIKTOKEN_PARITY to its work directory; skipped elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/data/bpe_tokenizer.h"
#include "tokenizer_test_util.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

std::string parity_dir() {
  const char* dir = std::getenv("MESHTRAIN_TIKTOKEN_PARITY");
  return dir != nullptr ? dir : "";
}

#define MESHTRAIN_NEED_PARITY_RUN()                                                         \
  do {                                                                                      \
    if (parity_dir().empty()) GTEST_SKIP() << "run by ctest -R tokenizer.tiktoken_parity"; \
  } while (0)

std::string shell_quote(const std::string& s) { return "'" + s + "'"; }

// Runs tiktoken_ref.py with `args` by the project's venv python (ctest sets it, never the
// PATH python); fails the test if it fails.
void run_reference(const std::string& args) {
  const char* python = std::getenv("MESHTRAIN_PYPI_PYTHON");
  ASSERT_NE(python, nullptr) << "MESHTRAIN_PYPI_PYTHON unset: run by ctest -R tokenizer.tiktoken_parity";
  std::string command = std::string(python) + " " +
                        shell_quote(std::string(MESHTRAIN_SOURCE_DIR) + "/tests/tokenizer/tiktoken_ref.py") +
                        " " + args;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
}

// Each file's ids from tiktoken, then from meshtrain; the first difference is reported.
void expect_same_ids(const std::vector<std::string>& files) {
  std::string ranks = testing::gpt2_ranks_path();
  std::string ids_path = parity_dir() + "/tiktoken.ids";
  // Appended piecewise: "literal" + std::string trips a GCC 12 -Wrestrict false positive.
  std::string args = "encode --ranks ";
  args += shell_quote(ranks);
  args += " --out ";
  args += shell_quote(ids_path);
  for (const auto& f : files) {
    args += ' ';
    args += shell_quote(f);
  }
  ASSERT_NO_FATAL_FAILURE(run_reference(args));
  std::string reference = testing::read_file(ids_path);
  auto tok = BpeTokenizer::load(ranks);
  size_t pos = 0;
  int64_t total = 0;
  for (const auto& file : files) {
    std::string text = testing::read_file(file);
    ASSERT_LE(pos + 4, reference.size()) << "reference ids end before " << file;
    int32_t count = 0;
    std::memcpy(&count, reference.data() + pos, 4);
    pos += 4;
    ASSERT_LE(pos + 4 * static_cast<size_t>(count), reference.size());
    std::vector<int32_t> want(static_cast<size_t>(count));
    std::memcpy(want.data(), reference.data() + pos, 4 * want.size());
    pos += 4 * want.size();
    std::vector<int32_t> got = tok->encode_ordinary(text);
    if (got != want) {
      auto diff = std::mismatch(got.begin(), got.end(), want.begin(), want.end());
      size_t at = static_cast<size_t>(diff.first - got.begin());
      size_t from = at >= 3 ? at - 3 : 0;
      auto window = [&](const std::vector<int32_t>& ids) {
        std::string s;
        for (size_t i = from; i < std::min(ids.size(), at + 4); ++i) s += std::to_string(ids[i]) + " ";
        return s + "| text '" +
               tok->decode(std::span(ids).subspan(from, std::min(ids.size(), at + 4) - from)) + "'";
      };
      ADD_FAILURE() << file << ": ids differ from token " << at << " (" << got.size() << " vs "
                    << want.size() << " tokens)\n  meshtrain: " << window(got)
                    << "\n  tiktoken:  " << window(want);
    }
    total += count;
  }
  EXPECT_EQ(pos, reference.size());
  EXPECT_GT(total, 0);
}

TEST(TiktokenParity, KingJamesBible) {
  MESHTRAIN_NEED_PARITY_RUN();
  std::vector<std::string> books;
  for (const auto& e : fs::directory_iterator(parity_dir() + "/kjv")) books.push_back(e.path().string());
  std::sort(books.begin(), books.end());
  ASSERT_EQ(books.size(), 66u) << "scripts/kjv_text.sh writes one file per book";
  expect_same_ids(books);
}

TEST(TiktokenParity, UnicodeStressText) {
  MESHTRAIN_NEED_PARITY_RUN();
  expect_same_ids({std::string(MESHTRAIN_SOURCE_DIR) + "/tests/tokenizer/unicode_stress.txt"});
}

TEST(TiktokenParity, EveryCodePointInContext) {
  MESHTRAIN_NEED_PARITY_RUN();
  std::string sweep = parity_dir() + "/sweep.txt";
  std::string args = "sweep ";
  args += shell_quote(sweep);
  ASSERT_NO_FATAL_FAILURE(run_reference(args));
  expect_same_ids({sweep});
}

}  // namespace
}  // namespace meshtrain
