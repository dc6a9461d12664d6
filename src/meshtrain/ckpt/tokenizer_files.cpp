#include "meshtrain/ckpt/tokenizer_files.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/data/bpe_tokenizer.h"
#include "meshtrain/data/byte_level.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

using ojson = nlohmann::ordered_json;

bool is_gpt2(const Tokenizer& t) { return t.name() == "gpt2"; }

// Ids with a byte string of their own (GPT-2: all but <|endoftext|>).
int32_t ordinary_ids(const Tokenizer& t) {
  return static_cast<int32_t>(is_gpt2(t) ? t.eot_id() : t.vocab_size());
}

std::string token_text(const Tokenizer& t, int32_t id) {
  const int32_t ids[] = {id};
  return t.decode(ids);
}

// The merges of tiktoken-style ranks, in rank order, each "a b" in ByteLevel text.
std::vector<std::string> bpe_merges(const Tokenizer& t) {
  const int32_t n = ordinary_ids(t);
  std::unordered_map<std::string, int32_t> rank;
  std::vector<std::string> tokens(static_cast<size_t>(n));
  for (int32_t id = 0; id < n; ++id) {
    tokens[static_cast<size_t>(id)] = token_text(t, id);
    rank.emplace(tokens[static_cast<size_t>(id)], id);
  }
  std::vector<std::string> merges;
  for (int32_t id = 0; id < n; ++id) {
    const std::string& token = tokens[static_cast<size_t>(id)];
    if (token.size() < 2) continue;
    std::vector<std::string> parts;
    for (char c : token) parts.emplace_back(1, c);
    while (parts.size() > 2) {
      size_t best = parts.size();
      int32_t best_rank = id;  // only merges below this token's own rank
      for (size_t i = 0; i + 1 < parts.size(); ++i) {
        auto it = rank.find(parts[i] + parts[i + 1]);
        if (it != rank.end() && it->second < best_rank) {
          best_rank = it->second;
          best = i;
        }
      }
      if (best == parts.size()) break;
      parts[best] += parts[best + 1];
      parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    }
    if (parts.size() == 2 && rank.count(parts[0]) && rank.count(parts[1])) {
      merges.push_back(byte_level(parts[0]) + " " + byte_level(parts[1]));
    }
  }
  return merges;
}

std::string special_text(const Tokenizer& t, int32_t id) {
  return is_gpt2(t) ? std::string(kEndOfText) : byte_level(token_text(t, id));
}

}  // namespace

SpecialIds special_ids(const Tokenizer& tokenizer) {
  // A tokenizer whose post-processor starts sequences (Llama's <s>) has its own BOS.
  const Tokenizer::DocumentFrame frame = tokenizer.document_frame();
  const int32_t eos = tokenizer.eot_id();
  return {frame.before.empty() ? eos : frame.before.front(), eos};
}

std::string hf_tokenizer_json(const Tokenizer& t) {
  const ojson byte_level_step = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                 {"trim_offsets", true}, {"use_regex", true}};
  ojson vocab = ojson::object();
  for (int32_t id = 0; id < ordinary_ids(t); ++id) vocab[byte_level(token_text(t, id))] = id;
  ojson added = ojson::array();
  if (is_gpt2(t)) {
    added.push_back({{"id", t.eot_id()}, {"content", kEndOfText}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                     {"special", true}});
    vocab[std::string(kEndOfText)] = t.eot_id();
  }
  ojson model = {{"type", "BPE"},
                 {"dropout", nullptr},
                 {"unk_token", nullptr},
                 {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr},
                 {"fuse_unk", false},
                 {"byte_fallback", false},
                 {"ignore_merges", false},
                 {"vocab", vocab},
                 {"merges", is_gpt2(t) ? ojson(bpe_merges(t)) : ojson::array()}};
  ojson j = {{"version", "1.0"},   {"truncation", nullptr},         {"padding", nullptr},
             {"added_tokens", added}, {"normalizer", nullptr},     {"pre_tokenizer", byte_level_step},
             {"post_processor", byte_level_step}, {"decoder", byte_level_step}, {"model", model}};
  return j.dump() + "\n";
}

std::string hf_tokenizer_config_json(const Tokenizer& t, int64_t model_max_length) {
  const SpecialIds ids = special_ids(t);
  ojson j = {{"tokenizer_class", "PreTrainedTokenizerFast"},
             {"bos_token", special_text(t, ids.bos)},
             {"eos_token", special_text(t, ids.eos)},
             {"unk_token", nullptr},
             {"pad_token", nullptr},
             {"add_bos_token", false},
             {"add_eos_token", false},
             {"add_prefix_space", false},
             {"clean_up_tokenization_spaces", false},
             {"model_max_length", model_max_length}};
  return j.dump(2) + "\n";
}

std::string hf_generation_config_json(const Tokenizer& t) {
  const SpecialIds ids = special_ids(t);
  ojson j = {{"bos_token_id", ids.bos}, {"eos_token_id", ids.eos}};
  return j.dump(2) + "\n";
}

void write_hf_tokenizer(const Tokenizer& t, int64_t model_max_length, const std::string& dir) {
  const std::filesystem::path d(dir);
  if (const std::vector<Tokenizer::File> files = t.files(); !files.empty()) {
    // A tokenizer read from files (a Hugging Face folder): those files, as they are.
    for (const Tokenizer::File& f : files) {
      write_file_atomic((d / f.name).string(), read_file_text(f.path));
    }
    write_file_atomic((d / "generation_config.json").string(), hf_generation_config_json(t));
    return;
  }
  write_file_atomic((d / "tokenizer.json").string(), hf_tokenizer_json(t));
  write_file_atomic((d / "tokenizer_config.json").string(),
                    hf_tokenizer_config_json(t, model_max_length));
  write_file_atomic((d / "generation_config.json").string(), hf_generation_config_json(t));
}

void write_llama2c_tokenizer(const Tokenizer& t, int64_t vocab_size, const std::string& path) {
  MESHTRAIN_CHECK(vocab_size >= t.vocab_size(),
                  "{}: the model's vocabulary ({}) is smaller than tokenizer '{}' ({} ids)", path,
                  vocab_size, t.name(), t.vocab_size());
  std::vector<std::string> tokens(static_cast<size_t>(vocab_size));
  int32_t max_len = 0;
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    tokens[static_cast<size_t>(id)] = token_text(t, id);
    max_len = std::max(max_len, static_cast<int32_t>(tokens[static_cast<size_t>(id)].size()));
  }
  AtomicFile file(path);
  file.write(&max_len, sizeof(max_len));
  for (int64_t id = 0; id < vocab_size; ++id) {
    const std::string& bytes = tokens[static_cast<size_t>(id)];
    const bool ranked = is_gpt2(t) && id < ordinary_ids(t) && bytes.size() > 1;
    const float score = ranked ? -static_cast<float>(id) : 0.0f;
    const auto len = static_cast<int32_t>(bytes.size());
    file.write(&score, sizeof(score));
    file.write(&len, sizeof(len));
    file.write(bytes.data(), bytes.size());
  }
  file.commit();
}

std::vector<Llama2cToken> read_llama2c_tokenizer(const std::string& path, int64_t vocab_size) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "{}: cannot open", path);
  int32_t max_len = 0;
  in.read(reinterpret_cast<char*>(&max_len), sizeof(max_len));
  MESHTRAIN_CHECK(in.good() && max_len >= 0, "{}: cannot read max_token_length", path);
  // Sizes are checked against the file before anything is allocated for them.
  std::error_code ec;
  int64_t left = static_cast<int64_t>(std::filesystem::file_size(path, ec)) - 4;
  MESHTRAIN_CHECK_AS(ErrorKind::io, !ec, "{}: cannot open: {}", path, ec.message());
  MESHTRAIN_CHECK(vocab_size >= 0 && vocab_size <= left / 8, "{}: {} bytes cannot hold {} tokens (8 bytes each at least)",
                  path, left + 4, vocab_size);
  std::vector<Llama2cToken> tokens(static_cast<size_t>(vocab_size));
  for (int64_t id = 0; id < vocab_size; ++id) {
    Llama2cToken& tok = tokens[static_cast<size_t>(id)];
    int32_t len = 0;
    in.read(reinterpret_cast<char*>(&tok.score), sizeof(tok.score));
    in.read(reinterpret_cast<char*>(&len), sizeof(len));
    MESHTRAIN_CHECK(in.good(), "{}: ends before token {} of {}", path, id, vocab_size);
    left -= 8;
    MESHTRAIN_CHECK(len >= 0 && len <= max_len, "{}: token {} has length {} (max_token_length {})",
                    path, id, len, max_len);
    MESHTRAIN_CHECK(len <= left, "{}: ends inside token {}", path, id);
    left -= len;
    tok.bytes.resize(static_cast<size_t>(len));
    in.read(tok.bytes.data(), len);
    MESHTRAIN_CHECK(in.good(), "{}: ends inside token {}", path, id);
  }
  MESHTRAIN_CHECK(in.peek() == std::char_traits<char>::eof(), "{}: bytes after the last of {} tokens",
                  path, vocab_size);
  return tokens;
}

void write_llmc_tokenizer(const Tokenizer& t, const std::string& path) {
  std::array<uint32_t, 256> header{};
  header[0] = kLlmcTokenizerMagic;
  header[1] = 2;  // version 2 records the eot id
  header[2] = static_cast<uint32_t>(t.vocab_size());
  header[3] = static_cast<uint32_t>(t.eot_id());
  AtomicFile file(path);
  file.write(header.data(), sizeof(header));
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    const std::string bytes = token_text(t, id);
    MESHTRAIN_CHECK(!bytes.empty() && bytes.size() < 256,
                    "{}: token {} has {} bytes; llm.c's tokenizer file holds 1 to 255", path, id,
                    bytes.size());
    const auto len = static_cast<uint8_t>(bytes.size());
    file.write(&len, 1);
    file.write(bytes.data(), bytes.size());
  }
  file.commit();
}

std::vector<std::string> read_llmc_tokenizer(const std::string& path, int32_t* eot) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "{}: cannot open", path);
  std::array<uint32_t, 256> header{};
  in.read(reinterpret_cast<char*>(header.data()), sizeof(header));
  MESHTRAIN_CHECK(in.good(), "{}: shorter than llm.c's 1024-byte tokenizer header", path);
  MESHTRAIN_CHECK(header[0] == kLlmcTokenizerMagic, "{}: bad magic {} (llm.c's tokenizer has {})",
                  path, header[0], kLlmcTokenizerMagic);
  MESHTRAIN_CHECK(header[1] == 1 || header[1] == 2, "{}: version {} is not 1 or 2", path,
                  header[1]);
  if (eot != nullptr) *eot = header[1] == 2 ? static_cast<int32_t>(header[3]) : 50256;
  // Each token takes 2 bytes at least: a count the file cannot hold is refused
  // before the vector is allocated for it.
  std::error_code ec;
  const uintmax_t bytes = std::filesystem::file_size(path, ec);
  MESHTRAIN_CHECK_AS(ErrorKind::io, !ec, "{}: cannot open: {}", path, ec.message());
  MESHTRAIN_CHECK(header[2] <= (bytes - sizeof(header)) / 2,
                  "{}: {} bytes cannot hold {} tokens (2 bytes each at least)", path, bytes,
                  header[2]);
  std::vector<std::string> tokens(header[2]);
  for (uint32_t id = 0; id < header[2]; ++id) {
    uint8_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 1);
    MESHTRAIN_CHECK(in.good() && len > 0, "{}: ends or breaks before token {} of {}", path, id,
                    header[2]);
    tokens[id].resize(len);
    in.read(tokens[id].data(), len);
    MESHTRAIN_CHECK(in.good(), "{}: ends inside token {}", path, id);
  }
  return tokens;
}

}  // namespace meshtrain
