// HfTokenizer against PyPI's tokenizers and SpmTokenizer against PyPI's
// sentencepiece (tests/tokenizer/hf_tokenizers_ref.py) on every fixture of
// tests/tokenizer/vocab: every Unicode scalar value alone
// and in context, random UTF-8, llama.cpp's edge cases and the whole KJV;
// encode with and without the post-processor, and decode. A case may differ
// only when its text holds a code point of tests/tokenizer/unicode_gaps.txt
// (where tokenizers' Unicode tables and meshtrain's libraries disagree; the
// counts are printed). Runs under ctest's
// tokenizer.hf_parity, which unpacks the fixtures, writes the KJV text and
// sets MESHTRAIN_HF_PARITY to its work directory; skipped elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "meshtrain/data/hf_tokenizer.h"
#include "tokenizer_test_util.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

std::string parity_dir() {
  const char* dir = std::getenv("MESHTRAIN_HF_PARITY");
  return dir != nullptr ? dir : "";
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

// The fixture's cases and tokenizers' answers, written by the reference.
std::string reference_cases(const std::string& name) {
  const char* python = std::getenv("MESHTRAIN_PYPI_PYTHON");
  EXPECT_NE(python, nullptr) << "MESHTRAIN_PYPI_PYTHON unset: run by ctest -R tokenizer.hf_parity";
  if (python == nullptr) return {};
  const std::string dir = parity_dir();
  const std::string out = dir + "/" + name + ".cases";
  // Appended piecewise: "literal" + std::string trips a GCC 12 -Wrestrict false positive.
  const std::string tests = std::string(MESHTRAIN_SOURCE_DIR) + "/tests/tokenizer/";
  std::string command = python;
  for (const std::string& part :
       {quote(tests + "hf_tokenizers_ref.py"), std::string("cases --tokenizer"),
        quote(dir + "/vocab/" + name), std::string("--out"), quote(out), std::string("--llama-cpp"),
        quote(tests + "llama_cpp_vocab_cases.inp"), std::string("--text")}) {
    command += ' ';
    command += part;
  }
  std::vector<std::string> books;
  for (const auto& e : fs::directory_iterator(dir + "/kjv")) books.push_back(e.path().string());
  std::sort(books.begin(), books.end());
  for (const std::string& b : books) {
    command += ' ';
    command += quote(b);
  }
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return out;
}

struct Reader {
  std::string data;
  size_t pos = 0;
  bool done() const { return pos >= data.size(); }
  template <class T>
  T scalar() {
    T v{};
    std::memcpy(&v, data.data() + pos, sizeof v);
    pos += sizeof v;
    return v;
  }
  std::string bytes() {
    const auto n = scalar<uint32_t>();
    std::string s = data.substr(pos, n);
    pos += n;
    return s;
  }
  std::vector<int32_t> ids() {
    const auto n = scalar<uint32_t>();
    std::vector<int32_t> v(n);
    if (n > 0) std::memcpy(v.data(), data.data() + pos, 4 * size_t{n});  // empty: data() may be null
    pos += 4 * size_t{n};
    return v;
  }
};

std::string show(std::span<const int32_t> ids) {
  std::string s;
  for (size_t i = 0; i < std::min<size_t>(ids.size(), 24); ++i) s += std::to_string(ids[i]) + " ";
  return s + (ids.size() > 24 ? "..." : "");
}

// tests/tokenizer/unicode_gaps.txt as [first, last] ranges.
std::vector<std::pair<uint32_t, uint32_t>> unicode_gaps() {
  std::istringstream in(
      testing::read_file(std::string(MESHTRAIN_SOURCE_DIR) + "/tests/tokenizer/unicode_gaps.txt"));
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    uint32_t a = 0, b = 0;
    fields >> std::hex >> a >> b;
    ranges.emplace_back(a, b);
  }
  return ranges;
}

bool has_gap(const std::string& text, const std::vector<std::pair<uint32_t, uint32_t>>& gaps) {
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = n == 1 ? c : c & (0xFF >> (n + 1));
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
    for (const auto& [a, b] : gaps) {
      if (cp >= a && cp <= b) return true;
    }
    i += n;
  }
  return false;
}

constexpr const char* kSets[] = {"code point alone", "code points in context", "random UTF-8",
                                 "llama.cpp edge case", "KJV book"};

// Which texts decode(encode(x)) must give back: all (byte-level, no
// normalizer), those without U+2581 (a pipeline that writes spaces as it),
// none (NFC; Metaspace's "first" scheme drops a leading space).
enum class RoundTrip { all, without_u2581, none };

// Every case of one fixture; the first few differences are reported in full.
void expect_parity(const std::string& name, RoundTrip round_trip) {
  if (parity_dir().empty()) GTEST_SKIP() << "run by ctest -R tokenizer.hf_parity";
  const std::string path = reference_cases(name);
  ASSERT_FALSE(path.empty());
  Reader r{testing::read_file(path)};
  const auto tok = make_tokenizer(parity_dir() + "/vocab/" + name, "");
  const auto gaps = unicode_gaps();
  ASSERT_GT(gaps.size(), 10u);
  int64_t cases[5] = {}, wrong[5] = {}, gap[5] = {};
  int reported = 0;
  auto report = [&](int set, const std::string& what, const std::string& text,
                    const std::string& ours, const std::string& theirs) {
    if (has_gap(text, gaps)) {
      ++gap[set];
      return;
    }
    ++wrong[set];
    if (reported++ < 5) {
      ADD_FAILURE() << name << ", " << kSets[set] << " '" << text.substr(0, 60) << "': " << what
                    << "\n  meshtrain:  " << ours << "\n  tokenizers: " << theirs;
    }
  };
  while (!r.done()) {
    const int set = r.scalar<uint8_t>();
    ASSERT_LT(set, 5);
    const std::string text = r.bytes();
    const std::vector<int32_t> want = r.ids();
    ++cases[set];
    std::vector<int32_t> got;
    tok->encode(text, got, false);
    if (got != want) report(set, "ids differ", text, show(got), show(want));
    if (set >= 3) {
      const std::vector<int32_t> want_framed = r.ids();
      std::vector<int32_t> framed;
      tok->encode(text, framed, true);
      if (framed != want_framed) report(set, "ids with special tokens differ", text, show(framed), show(want_framed));
    }
    const std::string decoded = r.bytes();
    const std::string ours = tok->decode(want);
    if (ours != decoded) report(set, "decode differs", text, ours.substr(0, 80), decoded.substr(0, 80));
    const bool round_trips = round_trip == RoundTrip::all ||
                             (round_trip == RoundTrip::without_u2581 &&
                              text.find("\xE2\x96\x81") == std::string::npos);
    if (round_trips && tok->decode(got) != text) report(set, "decode(encode(x)) != x", text, tok->decode(got), text);
  }
  for (int s = 0; s < 5; ++s) {
    std::printf("%-16s %-24s %8ld cases %6ld differ %6ld differ on a Unicode gap\n", name.c_str(),
                kSets[s], static_cast<long>(cases[s]), static_cast<long>(wrong[s]),
                static_cast<long>(gap[s]));
  }
  EXPECT_GT(cases[0], 1'000'000);
  EXPECT_EQ(cases[4], 66);
}

TEST(HfTokenizersParity, Gpt2) { expect_parity("gpt2", RoundTrip::all); }
TEST(HfTokenizersParity, Gpt2IndividualDigits) { expect_parity("gpt2-digits", RoundTrip::all); }
TEST(HfTokenizersParity, Qwen2Nfc) { expect_parity("qwen2", RoundTrip::none); }
TEST(HfTokenizersParity, Llama3Pipeline) { expect_parity("qwen2-llama3", RoundTrip::all); }
TEST(HfTokenizersParity, Phi3ByteFallback) { expect_parity("phi3", RoundTrip::without_u2581); }
TEST(HfTokenizersParity, Phi3Metaspace) { expect_parity("phi3-metaspace", RoundTrip::none); }
// SentencePiece models through Debian's libsentencepiece against PyPI's sentencepiece.
TEST(HfTokenizersParity, MistralV1SentencePiece) { expect_parity("mistral-v1", RoundTrip::none); }
TEST(HfTokenizersParity, MistralV3SentencePiece) { expect_parity("mistral-v3", RoundTrip::none); }

}  // namespace
}  // namespace meshtrain
