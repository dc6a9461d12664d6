#include "meshtrain/data/tokenizer.h"

#include <filesystem>

#include "meshtrain/data/bpe_tokenizer.h"
#include "meshtrain/data/hf_tokenizer.h"
#include "meshtrain/data/spm_tokenizer.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/text_file.h"

namespace meshtrain {


void ByteTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const {
  ids.reserve(ids.size() + text.size());
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    MESHTRAIN_CHECK(id >= 0 && id < 256, "tokenizer 'bytes': cannot decode id {}: not a byte", id);
    out.push_back(static_cast<char>(id));
  }
  return out;
}

std::vector<Tokenizer::File> tokenizer_files(std::string_view kind) {
  namespace fs = std::filesystem;
  const fs::path path(kind);
  if (kind == "gpt2" || kind == "bytes" || !fs::exists(path)) return {};
  if (!fs::is_directory(path)) {
    return {{path.string(), path.extension() == ".model" ? "tokenizer.model" : "tokenizer.json"}};
  }
  std::vector<Tokenizer::File> files;
  const bool json = fs::exists(path / "tokenizer.json");
  for (const char* name : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                           "chat_template.jinja"}) {
    // A folder with both: tokenizer.json is the one read.
    if (json && std::string_view(name) == "tokenizer.model") continue;
    if (fs::exists(path / name)) files.push_back({(path / name).string(), name});
  }
  return files;
}

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view kind, const std::string& gpt2_ranks) {
  if (kind == "gpt2") return BpeTokenizer::load(gpt2_ranks);
  if (kind == "bytes") return std::make_unique<ByteTokenizer>();
  const std::vector<Tokenizer::File> files = tokenizer_files(kind);
  MESHTRAIN_CHECK(!files.empty(), "tokenizer '{}': unknown (expected 'gpt2', 'bytes', a "
                  "tokenizer.json, a tokenizer.model or a folder with one)", kind);
  TokenizerConfig config;
  std::string json, model;
  for (const Tokenizer::File& f : files) {
    if (f.name == "tokenizer_config.json") config = read_tokenizer_config(f.path);
    if (f.name == "tokenizer.json") json = f.path;
    if (f.name == "tokenizer.model") model = f.path;
  }
  for (const Tokenizer::File& f : files) {  // the template file wins over the config's copy
    if (f.name == "chat_template.jinja") config.chat_template = read_file_text(f.path);
  }
  if (!json.empty()) return HfTokenizer::load(json, std::move(config), files);
  MESHTRAIN_CHECK(!model.empty(), "tokenizer '{}': the folder has no tokenizer.json or "
                  "tokenizer.model", kind);
  return SpmTokenizer::load(model, std::move(config), files);
}

std::string Tokenizer::token_text(int32_t id) const { return decode(std::span(&id, 1)); }

const TokenizerConfig& Tokenizer::config() const {
  static const TokenizerConfig none;
  return none;
}

namespace {

// Where token text `t` ends when laid at byte `pos` of `text`: exactly, after
// a space the tokenizer put in front (its dummy prefix), or taking a space its
// decoder drops; npos when it does not fit there.
size_t lay(std::string_view text, size_t pos, std::string_view t) {
  const auto at = [&](size_t p, std::string_view s) {
    return p <= text.size() && text.substr(p).starts_with(s);
  };
  if (at(pos, t) && !(t.empty() && at(pos, " "))) return pos + t.size();
  if (t.starts_with(' ') && at(pos, t.substr(1))) return pos + t.size() - 1;
  if (at(pos, " ") && at(pos + 1, t)) return pos + 1 + t.size();
  return std::string_view::npos;
}

}  // namespace

std::vector<std::pair<size_t, size_t>> token_offsets(const Tokenizer& tokenizer,
                                                     std::string_view text,
                                                     std::span<const int32_t> ids) {
  std::vector<std::string> texts;
  texts.reserve(ids.size());
  for (int32_t id : ids) texts.push_back(tokenizer.token_text(id));
  const size_t n = texts.size();
  // Whether tokens [k, k + 3) (or to the end) lie along the text from `pos`.
  const auto follows = [&](size_t k, size_t pos) {
    for (size_t j = k; j < std::min(n, k + 3); ++j) {
      pos = lay(text, pos, texts[j]);
      if (pos == std::string_view::npos) return false;
    }
    return k + 3 <= n || pos == text.size();
  };
  std::vector<std::pair<size_t, size_t>> spans;
  spans.reserve(n);
  size_t pos = 0;
  for (size_t k = 0; k < n;) {
    if (const size_t end = lay(text, pos, texts[k]); end != std::string_view::npos) {
      spans.emplace_back(pos, end);
      pos = end;
      ++k;
      continue;
    }
    // A stretch the normalizer changed (NFC of a decomposed accent, NFKC of
    // a ligature): the fewest tokens m and then the fewest bytes b after
    // which the two agree again; each of the m tokens spans all b bytes.
    // Normalizers change a length by a small factor (Hangul's NFC: 3), so a
    // stretch whose lengths differ by more than 4x is no such change.
    constexpr size_t kTokens = 32, kBytes = 128;
    bool found = false;
    size_t len = 0;  // of the m tokens' texts
    for (size_t m = 1; m <= kTokens && k + m <= n && !found; ++m) {
      len += texts[k + m - 1].size();
      for (size_t b = 1; b <= kBytes && pos + b <= text.size(); ++b) {
        if (len > 4 * b + 4 || b > 4 * len + 4 || !follows(k + m, pos + b)) continue;
        for (size_t j = 0; j < m; ++j) spans.emplace_back(pos, pos + b);
        pos += b;
        k += m;
        found = true;
        break;
      }
    }
    MESHTRAIN_CHECK(found, "tokenizer '{}': token {} ({:?}) does not follow the text at byte {} "
                    "({:?}), nor do the next tokens within {} bytes", tokenizer.name(), ids[k],
                    texts[k], pos, text.substr(pos, 16), kBytes);
  }
  MESHTRAIN_CHECK(pos == text.size(), "tokenizer '{}': the tokens cover {} of the text's {} bytes",
                  tokenizer.name(), pos, text.size());
  return spans;
}

size_t first_non_text_byte(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c == 0) return i;
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Length and the allowed range of the second byte (RFC 3629's table).
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    if (i + len > n || p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace meshtrain
