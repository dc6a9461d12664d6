#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/data/bpe_tokenizer.h"
#include "meshtrain/util/error.h"
#include "tokenizer_test_util.h"

namespace meshtrain {
namespace {

std::string base64(std::string_view bytes) {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t v = 0;
    size_t n = std::min<size_t>(3, bytes.size() - i);
    for (size_t j = 0; j < 3; ++j) {
      v = (v << 8) | (j < n ? static_cast<unsigned char>(bytes[i + j]) : 0u);
    }
    for (size_t j = 0; j < 4; ++j) out.push_back(j <= n ? digits[(v >> (18 - 6 * j)) & 63] : '=');
  }
  return out;
}

// A ranks file: the 256 single bytes (rank = byte value), then `merges` in order.
std::string ranks_text(const std::vector<std::string>& merges) {
  std::string text;
  for (int b = 0; b < 256; ++b) {
    text += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  }
  for (size_t i = 0; i < merges.size(); ++i) {
    text += base64(merges[i]) + " " + std::to_string(256 + i) + "\n";
  }
  return text;
}

// The textbook algorithm: merge the leftmost lowest-ranked adjacent pair until none is a token.
std::vector<int32_t> naive_merge(const std::string& piece, const std::map<std::string, int>& ranks) {
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  for (;;) {
    int best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = ranks.find(parts[i] + parts[i + 1]);
      if (it != ranks.end() && (best < 0 || it->second < best)) {
        best = it->second;
        at = i;
      }
    }
    if (best < 0) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  std::vector<int32_t> ids;
  for (const auto& p : parts) ids.push_back(p.size() == 1 ? static_cast<unsigned char>(p[0]) : ranks.at(p));
  return ids;
}

using Ids = std::vector<int32_t>;

TEST(ByteTokenizer, RoundTripsEveryByte) {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  Ids ids = tok.encode_ordinary(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(tok.decode(ids), all);
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.eot_id(), 0);
  Ids bad{65, 256};
  EXPECT_THROW(tok.decode(bad), Error);
}

TEST(TextCheck, FindsTheFirstByteThatIsNotUtf8Text) {
  constexpr size_t npos = std::string_view::npos;
  EXPECT_EQ(first_non_text_byte(""), npos);
  EXPECT_EQ(first_non_text_byte("plain ASCII\n\t"), npos);
  EXPECT_EQ(first_non_text_byte("na\xc3\xafve \xe2\x80\x94 \xf0\x9f\x99\x82"), npos);  // ï — 🙂
  EXPECT_EQ(first_non_text_byte("ab\x80"), 2u);              // a lone continuation byte
  EXPECT_EQ(first_non_text_byte("ab\xc3"), 2u);              // truncated at the end
  EXPECT_EQ(first_non_text_byte("\xc0\xaf"), 0u);           // overlong '/'
  EXPECT_EQ(first_non_text_byte("x\xe0\x80\xaf"), 1u);      // overlong three-byte form
  EXPECT_EQ(first_non_text_byte("\xed\xa0\x80"), 0u);       // a UTF-16 surrogate
  EXPECT_EQ(first_non_text_byte("\xf4\x90\x80\x80"), 0u);  // past U+10FFFF
  EXPECT_EQ(first_non_text_byte("\xe2\x28\xa1"), 0u);       // bad second byte
  EXPECT_EQ(first_non_text_byte(std::string_view("ok\0zero", 7)), 2u);  // NUL is not text
}

TEST(BpeTokenizer, MergesTheLowestRankFirstAndLeftmostOnTies) {
  auto tok = BpeTokenizer::from_ranks_text(ranks_text({"ab", "bc", "abc", "aa"}), "toy");
  EXPECT_EQ(tok->vocab_size(), 261);
  EXPECT_EQ(tok->eot_id(), 260);
  EXPECT_EQ(tok->encode_ordinary("abc"), (Ids{258}));       // a whole token
  EXPECT_EQ(tok->encode_ordinary("abcd"), (Ids{258, 'd'}));  // ab, then abc
  EXPECT_EQ(tok->encode_ordinary("bcd"), (Ids{257, 'd'}));
  EXPECT_EQ(tok->encode_ordinary("aaa"), (Ids{259, 'a'}));   // leftmost of two equal pairs
  EXPECT_EQ(tok->encode_ordinary("aaaa"), (Ids{259, 259}));
  // Pre-tokenisation keeps merges inside pieces: " ab" is one piece, "ab" after "c " another.
  EXPECT_EQ(tok->encode_ordinary("c ab"), (Ids{'c', ' ', 256}));

  auto lower_bc = BpeTokenizer::from_ranks_text(ranks_text({"bc", "ab"}), "toy2");
  EXPECT_EQ(lower_bc->encode_ordinary("abcd"), (Ids{'a', 256, 'd'}));
}

// Pieces of any length (long ones take a heap-based path) merge as the textbook does.
TEST(BpeTokenizer, MatchesNaiveMergingAtEveryLength) {
  std::mt19937 rng(7);
  std::vector<std::string> merges;
  for (int len = 2; len <= 4; ++len) {
    for (int code = 0; code < (len == 2 ? 9 : len == 3 ? 27 : 81); ++code) {
      std::string s;
      for (int c = code, i = 0; i < len; ++i, c /= 3) s.push_back(static_cast<char>('a' + c % 3));
      merges.push_back(s);
    }
  }
  std::shuffle(merges.begin(), merges.end(), rng);
  std::map<std::string, int> ranks;
  for (size_t i = 0; i < merges.size(); ++i) ranks[merges[i]] = 256 + static_cast<int>(i);
  auto tok = BpeTokenizer::from_ranks_text(ranks_text(merges), "toy");
  for (int len = 1; len <= 400; len += (len < 140 ? 1 : 13)) {
    std::string piece;
    for (int i = 0; i < len; ++i) piece.push_back(static_cast<char>('a' + rng() % 3));
    ASSERT_EQ(tok->encode_ordinary(piece), naive_merge(piece, ranks)) << "piece " << piece;
  }
}

void expect_error(const std::string& ranks, const std::vector<std::string>& parts) {
  try {
    BpeTokenizer::from_ranks_text(ranks, "bad.tiktoken");
    ADD_FAILURE() << "no error; expected one with '" << parts.front() << "'";
  } catch (const Error& e) {
    std::string message = e.what();
    EXPECT_NE(message.find("bad.tiktoken"), std::string::npos) << message;
    for (const auto& p : parts) EXPECT_NE(message.find(p), std::string::npos) << message;
  }
}

TEST(BpeTokenizer, RejectsBadRanksWithFileAndLine) {
  std::string good = ranks_text({});
  expect_error("", {"no tokens"});
  expect_error(good + "YWI=\n", {"line 257", "expected '<base64 token bytes> <rank>'"});
  expect_error(good + "YWI=  256\n", {"line 257", "expected"});
  expect_error(good + "!!!! 256\n", {"line 257", "not base64"});
  expect_error(good + "YW= 256\n", {"line 257", "not base64"});
  expect_error(good + "Y=Jj 256\n", {"line 257", "not base64"});
  expect_error(good + "YWI= x\n", {"line 257", "not a non-negative integer"});
  expect_error(good + "YWI= -1\n", {"line 257", "not a non-negative integer"});
  expect_error(good + "YWI= 5\n", {"line 257", "rank 5 already given on line 6"});
  expect_error(good + "YQ== 256\n", {"same token bytes as rank 97"});
  expect_error(good + "YWI= 300\n", {"line 257", "rank 300 out of range (ranks are 0..256"});
  std::string no_a;  // every byte but 'A', ranks kept dense
  for (int b = 0, r = 0; b < 256; ++b) {
    if (b != 'A') no_a += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(r++) + "\n";
  }
  expect_error(no_a, {"byte 0x41 has no token"});
  EXPECT_NO_THROW(BpeTokenizer::from_ranks_text(good + "YWI= 256\r\n\n", "crlf and blank lines"));
}

TEST(BpeTokenizer, LoadNamesTheFile) {
  std::string dir = testing::scratch_dir();
  try {
    BpeTokenizer::load(dir + "/absent.tiktoken");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/absent.tiktoken"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
  testing::write_file(dir + "/bad.tiktoken", ranks_text({}) + "YWI= 256 7\n");
  try {
    BpeTokenizer::load(dir + "/bad.tiktoken");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/bad.tiktoken' line 257"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(make_tokenizer("sentencepiece", dir + "/bad.tiktoken"), Error);
}

TEST(Gpt2Tokenizer, KnownIds) {
  MESHTRAIN_NEED_GPT2_RANKS();
  auto tok = make_tokenizer("gpt2", testing::gpt2_ranks_path());
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eot_id(), 50256);
  EXPECT_EQ(tok->encode_ordinary("Hello world"), (Ids{15496, 995}));
  EXPECT_EQ(tok->encode_ordinary("In the beginning God created the heaven and the earth."),
            (Ids{818, 262, 3726, 1793, 2727, 262, 9538, 290, 262, 4534, 13}));
  EXPECT_EQ(tok->encode_ordinary("  it's 2024!\n\n"), (Ids{220, 340, 338, 48609, 0, 628}));
  // Special-token text is ordinary text; only the id 50256 is <|endoftext|>.
  EXPECT_EQ(tok->encode_ordinary("<|endoftext|>"), (Ids{27, 91, 437, 1659, 5239, 91, 29}));
  EXPECT_EQ(tok->decode(Ids{15496, 50256, 995}), "Hello<|endoftext|> world");
  EXPECT_THROW(tok->decode(Ids{50257}), Error);
  EXPECT_THROW(tok->decode(Ids{-1}), Error);
}

// Random code points from every range that matters, as UTF-8.
std::string random_utf8(std::mt19937& rng, int max_chars) {
  static const char32_t spaces[] = {' ', '\t', '\n', '\r', 0x0b, 0x0c, 0x85, 0xa0, 0x2028, 0x3000};
  std::string s;
  int n = static_cast<int>(rng() % static_cast<unsigned>(max_chars + 1));
  for (int i = 0; i < n; ++i) {
    char32_t cp;
    switch (rng() % 6) {
      case 0: cp = 0x20 + rng() % 0x5f; break;               // printable ASCII
      case 1: cp = spaces[rng() % std::size(spaces)]; break;  // whitespace
      case 2: cp = "'sdtlmrve0123456789"[rng() % 19]; break;  // contraction and digit material
      case 3: cp = 0x80 + rng() % 0x780; break;              // two-byte
      case 4: cp = 0x800 + rng() % (0x10000 - 0x800); break;  // three-byte
      default: cp = 0x10000 + rng() % 0x100000; break;        // four-byte
    }
    if (cp >= 0xd800 && cp <= 0xdfff) cp = 'x';
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s.push_back(static_cast<char>(0xc0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      s.push_back(static_cast<char>(0xe0 | (cp >> 12)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      s.push_back(static_cast<char>(0xf0 | (cp >> 18)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }
  return s;
}

TEST(Gpt2Tokenizer, DecodeOfEncodeIsIdentityOnRandomText) {
  MESHTRAIN_NEED_GPT2_RANKS();
  auto tok = make_tokenizer("gpt2", testing::gpt2_ranks_path());
  std::mt19937 rng(2024);
  for (int i = 0; i < 2000; ++i) {
    std::string text = random_utf8(rng, 60);
    Ids ids = tok->encode_ordinary(text);
    ASSERT_EQ(tok->decode(ids), text) << "case " << i;
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < 50256);
  }
  // Arbitrary bytes (mostly invalid UTF-8) survive too.
  for (int i = 0; i < 500; ++i) {
    std::string bytes(rng() % 40, '\0');
    for (auto& c : bytes) c = static_cast<char>(rng());
    ASSERT_EQ(tok->decode(tok->encode_ordinary(bytes)), bytes) << "byte case " << i;
  }
}

// Long pieces take the heap-based merge; ids as tiktoken gives them.
TEST(Gpt2Tokenizer, LongRuns) {
  MESHTRAIN_NEED_GPT2_RANKS();
  auto tok = make_tokenizer("gpt2", testing::gpt2_ranks_path());
  Ids spaces(99999, 220);  // GPT-2 has no multi-space tokens
  spaces.push_back(2124);  // " x"
  EXPECT_EQ(tok->encode_ordinary(std::string(100000, ' ') + "x"), spaces);
  EXPECT_EQ(tok->encode_ordinary(std::string(50000, '7')), Ids(25000, 3324));    // "77"
  EXPECT_EQ(tok->encode_ordinary(std::string(30000, 'a')), Ids(7500, 24794));    // "aaaa"
  std::string mixed = std::string(3000, '\n') + "\t \t" + std::string(5000, '!');
  EXPECT_EQ(tok->decode(tok->encode_ordinary(mixed)), mixed);
}

TEST(Gpt2Tokenizer, ThreadsShareOneTokenizer) {
  MESHTRAIN_NEED_GPT2_RANKS();
  auto tok = make_tokenizer("gpt2", testing::gpt2_ranks_path());
  std::mt19937 rng(5);
  std::string text;
  for (int i = 0; i < 200; ++i) text += random_utf8(rng, 50) + " the Lord's word 1611\n";
  Ids expected = tok->encode_ordinary(text);
  std::vector<Ids> got(2);
  std::vector<std::thread> threads;
  for (auto& g : got) threads.emplace_back([&] { g = tok->encode_ordinary(text); });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

}  // namespace
}  // namespace meshtrain
