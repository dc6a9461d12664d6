// HfTokenizer (data/hf_tokenizer.h): the committed real vocabularies against
// the ids llama.cpp recorded from the original Hugging Face tokenizers (ctest
// tokenizer.hf_originals unpacks them), and small tokenizer.json files for the
// rules and the refusals. The exactness suite against PyPI's tokenizers is
// hf_tokenizer_parity_test.cpp.
#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "meshtrain/data/hf_tokenizer.h"
#include "meshtrain/data/prepare.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/util/error.h"
#include "tokenizer_test_util.h"

namespace meshtrain {
namespace {

std::vector<int32_t> encode(const Tokenizer& t, std::string_view text, bool add_special = false) {
  std::vector<int32_t> ids;
  t.encode(text, ids, add_special);
  return ids;
}

// llama.cpp's tests/ inputs and, per vocabulary, the ids its
// convert_hf_to_gguf_update.py recorded from AutoTokenizer of the real model.
void expect_originals(const std::string& fixture, const std::string& recorded) {
  const char* vocab = std::getenv("MESHTRAIN_HF_VOCAB");
  if (vocab == nullptr) GTEST_SKIP() << "run by ctest -R tokenizer.hf_originals";
  const auto tok = make_tokenizer(std::string(vocab) + "/" + fixture, "");
  const std::string dir = std::string(MESHTRAIN_SOURCE_DIR) + "/tests/tokenizer/";
  const std::string inputs = testing::read_file(dir + "llama_cpp_vocab_cases.inp");
  const std::string lines = testing::read_file(dir + recorded);  // one line of ids per case
  const std::string sep = "\n__ggml_vocab_test__\n";
  size_t start = 0, line_start = 0, count = 0;
  for (; start <= inputs.size() && line_start < lines.size(); ++count) {
    const size_t end = std::min(inputs.find(sep, start), inputs.size());
    const std::string text = inputs.substr(start, end - start);
    start = end + sep.size();
    const size_t line_end = std::min(lines.find('\n', line_start), lines.size());
    std::istringstream words(lines.substr(line_start, line_end - line_start));
    line_start = line_end + 1;
    std::vector<int32_t> want;
    for (int32_t id; words >> id;) want.push_back(id);
    EXPECT_EQ(encode(*tok, text), want) << fixture << " case " << count << ": '" << text << "'";
  }
  EXPECT_EQ(count, 46u);
}

TEST(HfTokenizerOriginals, Gpt2) { expect_originals("gpt2", "llama_cpp_vocab_cases.gpt-2.out"); }
TEST(HfTokenizerOriginals, Qwen2) { expect_originals("qwen2", "llama_cpp_vocab_cases.qwen2.out"); }
TEST(HfTokenizerOriginals, Phi3) { expect_originals("phi3", "llama_cpp_vocab_cases.phi-3.out"); }

// prepare with a real vocabulary past 65536 ids: uint32 token files, each
// document between the tokenizer's own tokens (a BOS template before it; a
// tokenizer without one: its eos_token after it).
TEST(HfTokenizerOriginals, PrepareFramesDocumentsWithTheTokenizersOwnTokens) {
  const char* vocab = std::getenv("MESHTRAIN_HF_VOCAB");
  if (vocab == nullptr) GTEST_SKIP() << "run by ctest -R tokenizer.hf_originals";
  const std::string dir = testing::scratch_dir();
  const std::string doc = "In the beginning God created the heaven and the earth.";
  testing::write_file(dir + "/a.txt", doc);
  for (const char* name : {"qwen2", "qwen2-llama3"}) {
    PrepareOptions o;
    o.inputs = {dir + "/a.txt"};
    o.output_dir = dir + "/" + name;
    o.tokenizer = std::string(vocab) + "/" + name;
    o.progress = "none";
    const PrepareSummary s = prepare_corpus(o, nullptr);
    ASSERT_EQ(s.train_files.size(), 1u);
    const TokenFile f(s.train_files[0]);
    EXPECT_EQ(f.bytes_per_token(), 4);
    std::vector<int32_t> got(static_cast<size_t>(f.size()));
    f.read(0, f.size(), got.data());
    const auto tok = make_tokenizer(o.tokenizer, "");
    std::vector<int32_t> want = tok->document_frame().before;
    tok->encode_ordinary(doc, want);
    for (int32_t id : tok->document_frame().after) want.push_back(id);
    EXPECT_EQ(got, want) << name;
  }
  const auto qwen = make_tokenizer(std::string(vocab) + "/qwen2", "");
  EXPECT_EQ(qwen->document_frame().after, (std::vector<int32_t>{151643}));  // <|endoftext|>
  const auto llama3 = make_tokenizer(std::string(vocab) + "/qwen2-llama3", "");
  EXPECT_EQ(llama3->document_frame().before, (std::vector<int32_t>{151643}));
  EXPECT_TRUE(llama3->document_frame().after.empty());
}

// A character-level BPE over a, b, c: merges (a b) then (ab c), in either
// merges format; `extra` is spliced into the top-level object.
std::string tiny(const std::string& merges, const std::string& extra = "",
                 const std::string& model_extra = "") {
  return R"({"added_tokens": [{"id": 7, "content": "<x>", "special": true, "rstrip": true},
                             {"id": 8, "content": "<w>", "special": false, "single_word": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Fuse"}, )" +
         extra + R"("model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4,
            "abc": 5, " ": 6}, )" +
         model_extra + R"("merges": )" + merges + "}}";
}

TEST(HfTokenizer, MergesInBothFormatsAndRankOrder) {
  const auto strings = HfTokenizer::from_json(tiny(R"(["a b", "ab c", "b c"])"), "tiny");
  const auto pairs = HfTokenizer::from_json(tiny(R"([["a", "b"], ["ab", "c"], ["b", "c"]])"), "tiny");
  for (const auto* t : {strings.get(), pairs.get()}) {
    EXPECT_EQ(encode(*t, "abc"), (std::vector<int32_t>{5}));
    EXPECT_EQ(encode(*t, "bcab"), (std::vector<int32_t>{4, 3}));
    EXPECT_EQ(t->decode(encode(*t, "cab abc")), "cab abc");
  }
  // (b c) ranked first: "abc" becomes a + bc, and (a bc) is no merge.
  const auto bc_first = HfTokenizer::from_json(tiny(R"(["b c", "a b", "ab c"])"), "tiny");
  EXPECT_EQ(encode(*bc_first, "abc"), (std::vector<int32_t>{0, 4}));
  // ignore_merges: a word in the vocabulary is one token whatever the merges.
  const auto whole = HfTokenizer::from_json(tiny(R"(["b c"])", "", R"("ignore_merges": true, )"), "tiny");
  EXPECT_EQ(encode(*whole, "abc"), (std::vector<int32_t>{5}));
}

TEST(HfTokenizer, AddedTokensStripAndWholeWords) {
  const auto t = HfTokenizer::from_json(tiny(R"(["a b"])"), "tiny");
  // <x> takes the spaces after it (rstrip); special tokens are text to encode_ordinary.
  EXPECT_EQ(encode(*t, "a<x>  b"), (std::vector<int32_t>{0, 7, 1}));
  std::vector<int32_t> plain;
  t->encode_ordinary("<x>", plain);
  EXPECT_NE(plain, (std::vector<int32_t>{7}));
  EXPECT_EQ(t->token_id("<x>"), 7);
  // <w> only as a whole word.
  EXPECT_EQ(encode(*t, "a <w> b"), (std::vector<int32_t>{0, 6, 8, 6, 1}));
  EXPECT_NE(encode(*t, "a<w>b"), (std::vector<int32_t>{0, 8, 1}));
}

TEST(HfTokenizer, PostProcessorFramesTheIds) {
  const std::string post = R"("post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<x>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<x>", "type_id": 0}}],
      "special_tokens": {"<x>": {"id": "<x>", "ids": [7], "tokens": ["<x>"]}}},)";
  std::string json = tiny(R"(["a b"])");
  const std::string none = R"("post_processor": null,)";
  json.replace(json.find(none), none.size(), post);
  const auto t = HfTokenizer::from_json(json, "tiny");
  EXPECT_EQ(encode(*t, "ab", true), (std::vector<int32_t>{7, 3, 7}));
  EXPECT_EQ(encode(*t, "ab", false), (std::vector<int32_t>{3}));
  EXPECT_EQ(t->eot_id(), 7);
  EXPECT_EQ(t->document_frame().before, (std::vector<int32_t>{7}));
}

// Each token's bytes in the text (chat masks read them): where a normalizer
// rewrote the text ("x" -> "ab" here, NFC in Qwen2), the rewritten stretch's
// tokens span the original bytes; written-out added tokens span themselves.
TEST(HfTokenizer, TokenOffsetsFollowTheTextThroughNormalizedStretches) {
  std::string json = tiny(R"(["a b", "ab c"])");
  const std::string none = R"("normalizer": null,)";
  json.replace(json.find(none), none.size(),
               R"("normalizer": {"type": "Replace", "pattern": {"String": "x"}, "content": "ab"},)");
  const auto t = HfTokenizer::from_json(json, "tiny");
  const std::string text = "c x<x>abc xc";
  const std::vector<int32_t> ids = encode(*t, text);
  ASSERT_EQ(ids, (std::vector<int32_t>{2, 6, 3, 7, 5, 6, 5}));  // "xc" -> "abc"
  using Spans = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(token_offsets(*t, text, ids),
            (Spans{{0, 1}, {1, 2}, {2, 3}, {3, 6}, {6, 9}, {9, 10}, {10, 12}}));
  // Ids that are not this text's tokens: refused, naming the token and the byte.
  const std::vector<int32_t> wrong{5, 5, 5, 5, 5};
  EXPECT_THROW(token_offsets(*t, "ab", wrong), Error);
}

// One line naming the file and the field for each configuration not implemented.
TEST(HfTokenizer, RefusesWhatItDoesNotImplementByName) {
  auto refused = [](const std::string& json, const std::string& needle) {
    try {
      HfTokenizer::from_json(json, "bad.json");
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("bad.json"), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  };
  std::string unigram = tiny("[]");
  unigram.replace(unigram.find(R"("type": "BPE")"), 13, R"("type": "Unigram")");
  refused(unigram, "model type \"Unigram\" is not implemented");
  std::string lowercase = tiny("[]");
  lowercase.replace(lowercase.find(R"("normalizer": null)"), 18, R"("normalizer": {"type": "Lowercase"})");
  refused(lowercase, "normalizer \"Lowercase\" is not implemented");
  refused(tiny("[]", "", R"("dropout": 0.1, )"), "\"dropout\" = 0.1 is not implemented");
  refused(tiny(R"(["a z"])"), "merges[0] joins tokens that are not all in the vocabulary");
  refused("{not json", "not JSON");
}

}  // namespace
}  // namespace meshtrain
