#include "meshtrain/data/hf_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "meshtrain/data/byte_level.h"
#include "meshtrain/data/regex.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/text_file.h"

namespace meshtrain {
namespace {

using json = nlohmann::json;

// tokenizers' ByteLevel regex (GPT-2's).
constexpr std::string_view kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581

// The length of the UTF-8 character starting at text[i]; 1 for a byte that
// does not start a well-formed one (it stands alone, as a broken character).
size_t char_length(std::string_view text, size_t i) {
  const auto c = static_cast<unsigned char>(text[i]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + n > text.size()) return 1;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return 1;
  }
  return n;
}

uint32_t code_point(std::string_view text, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(text[i + k])); };
  switch (n) {
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    case 4: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
    default: return b(0);
  }
}

// Rust's char::is_whitespace (Unicode White_Space).
bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// The field's value, with one line naming the file and the field when it is
// missing or of another type.
struct Fields {
  const json& j;
  std::string where;  // "tokenizer.json 'x' model"

  const json& at(const char* key) const {
    MESHTRAIN_CHECK(j.is_object() && j.contains(key), "{}: missing \"{}\"", where, key);
    return j.at(key);
  }
  std::string string(const char* key) const {
    const json& v = at(key);
    MESHTRAIN_CHECK(v.is_string(), "{}: \"{}\" must be a string", where, key);
    return v.get<std::string>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!j.contains(key) || j.at(key).is_null()) return fallback;
    MESHTRAIN_CHECK(j.at(key).is_boolean(), "{}: \"{}\" must be true or false", where, key);
    return j.at(key).get<bool>();
  }
  int64_t integer(const char* key) const {
    const json& v = at(key);
    MESHTRAIN_CHECK(v.is_number_integer(), "{}: \"{}\" must be an integer", where, key);
    return v.get<int64_t>();
  }
  // Fields that must be absent or null (features not implemented).
  void require_null(const char* key, std::string_view why) const {
    MESHTRAIN_CHECK(!j.contains(key) || j.at(key).is_null() ||
                        (j.at(key).is_string() && j.at(key).get<std::string>().empty()),
                    "{}: \"{}\" = {} is not implemented ({})", where, key, j.at(key).dump(), why);
  }
  Fields child(const json& sub, std::string_view name) const {
    return {sub, where + " " + std::string(name)};
  }
};

// ---- patterns and splitting (tokenizers' NormalizedString::split) ----------

// A string or a regex ({"String": s} or {"Regex": r}); matches cover a text as
// alternating (range, is_match) pieces.
class Pattern {
 public:
  Pattern(const Fields& f) {
    const json& p = f.at("pattern");
    if (p.contains("String")) {
      literal_ = p.at("String").get<std::string>();
      MESHTRAIN_CHECK(!literal_.empty(), "{}: an empty \"String\" pattern", f.where);
    } else {
      MESHTRAIN_CHECK(p.contains("Regex"), "{}: \"pattern\" must be {{\"String\"}} or {{\"Regex\"}}",
                      f.where);
      regex_ = std::make_shared<Regex>(p.at("Regex").get<std::string>(), f.where);
    }
  }
  explicit Pattern(std::shared_ptr<Regex> regex) : regex_(std::move(regex)) {}
  static Pattern literal(std::string text) {
    Pattern p;
    p.literal_ = std::move(text);
    return p;
  }

  struct Piece {
    size_t start, end;
    bool match;
  };
  std::vector<Piece> pieces(std::string_view text, bool invert) const {
    std::vector<Piece> out;
    size_t prev = 0;
    auto add = [&](size_t s, size_t e) {
      if (prev != s) out.push_back({prev, s, invert});
      out.push_back({s, e, !invert});
      prev = e;
    };
    if (regex_) {
      Regex::Scratch scratch(*regex_);
      regex_->for_each_match(text, scratch, add);
    } else {
      for (size_t at = text.find(literal_); at != std::string_view::npos;
           at = text.find(literal_, at + literal_.size())) {
        add(at, at + literal_.size());
      }
    }
    if (prev != text.size()) out.push_back({prev, text.size(), invert});
    return out;
  }
  std::string replace_all(std::string_view text, std::string_view with) const {
    std::string out;
    for (const Piece& p : pieces(text, false)) {
      if (p.match) {
        out += with;
      } else {
        out += text.substr(p.start, p.end - p.start);
      }
    }
    return out;
  }

 private:
  Pattern() = default;
  std::string literal_;
  std::shared_ptr<Regex> regex_;
};

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

Behavior parse_behavior(const Fields& f) {
  const std::string b = f.string("behavior");
  if (b == "Removed") return Behavior::removed;
  if (b == "Isolated") return Behavior::isolated;
  if (b == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (b == "MergedWithNext") return Behavior::merged_with_next;
  if (b == "Contiguous") return Behavior::contiguous;
  fail("{}: \"behavior\" \"{}\" is not one of Removed, Isolated, MergedWithPrevious, "
       "MergedWithNext, Contiguous", f.where, b);
}

// The ranges a piece splits into (non-empty), as tokenizers' split() does.
std::vector<std::pair<size_t, size_t>> split_ranges(std::vector<Pattern::Piece> m, Behavior b) {
  std::vector<Pattern::Piece> out;
  bool previous_match = false;
  switch (b) {
    case Behavior::removed:
      for (const auto& p : m) {
        if (!p.match) out.push_back(p);
      }
      break;
    case Behavior::isolated: out = std::move(m); break;
    case Behavior::merged_with_previous:
      for (const auto& p : m) {
        if (p.match && !previous_match && !out.empty()) {
          out.back().end = p.end;
        } else {
          out.push_back(p);
        }
        previous_match = p.match;
      }
      break;
    case Behavior::merged_with_next:
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        if (it->match && !previous_match && !out.empty()) {
          out.back().start = it->start;
        } else {
          out.push_back(*it);
        }
        previous_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
    case Behavior::contiguous:
      for (const auto& p : m) {
        if (p.match == previous_match && !out.empty()) {
          out.back().end = p.end;
        } else {
          out.push_back(p);
        }
        previous_match = p.match;
      }
      break;
  }
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& p : out) {
    if (p.end > p.start) ranges.emplace_back(p.start, p.end);
  }
  return ranges;
}

// ---- normalizers --------------------------------------------------------------

using Normalize = std::function<void(std::string&)>;

std::string utf8proc_map_text(std::string_view text, int options, std::string_view where) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &out,
                   static_cast<utf8proc_option_t>(options | UTF8PROC_STABLE));
  MESHTRAIN_CHECK(n >= 0, "{}: Unicode normalization failed: {}", where, utf8proc_errmsg(n));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

Normalize parse_normalizer(const Fields& f) {
  const std::string type = f.string("type");
  if (type == "Sequence") {
    std::vector<Normalize> steps;
    const json& list = f.at("normalizers");
    for (size_t i = 0; i < list.size(); ++i) {
      steps.push_back(parse_normalizer(f.child(list[i], fmt::format("normalizers[{}]", i))));
    }
    return [steps](std::string& s) {
      for (const Normalize& n : steps) n(s);
    };
  }
  const auto unicode = [&](int options) -> Normalize {
    const std::string where = f.where;
    return [options, where](std::string& s) { s = utf8proc_map_text(s, options, where); };
  };
  if (type == "NFC") return unicode(UTF8PROC_COMPOSE);
  if (type == "NFD") return unicode(UTF8PROC_DECOMPOSE);
  if (type == "NFKC") return unicode(UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  if (type == "NFKD") return unicode(UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  if (type == "Prepend") {
    const std::string prefix = f.string("prepend");
    return [prefix](std::string& s) {
      if (!s.empty()) s.insert(0, prefix);
    };
  }
  if (type == "Replace") {
    auto pattern = std::make_shared<Pattern>(f);
    const std::string content = f.string("content");
    return [pattern, content](std::string& s) { s = pattern->replace_all(s, content); };
  }
  if (type == "Strip") {
    const bool left = f.boolean("strip_left", false), right = f.boolean("strip_right", false);
    return [left, right](std::string& s) {
      size_t begin = 0, end = s.size();
      while (left && begin < end) {
        const size_t n = char_length(s, begin);
        if (!is_white_space(code_point(s, begin, n))) break;
        begin += n;
      }
      while (right && end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
        if (!is_white_space(code_point(s, start, end - start))) break;
        end = start;
      }
      s = s.substr(begin, end - begin);
    };
  }
  fail("{}: normalizer \"{}\" is not implemented (NFC, NFD, NFKC, NFKD, Prepend, Replace, "
       "Strip, Sequence)", f.where, type);
}

// ---- pre-tokenizers -------------------------------------------------------------

// A stretch of text on its way to the model; `first`: it starts at byte 0 of
// the input (Metaspace's prepend_scheme "first").
struct Piece {
  std::string text;
  bool first = false;
};
using PreTokenize = std::function<void(std::vector<Piece>&)>;

// Replaces each piece by its parts.
template <class F>
void split_each(std::vector<Piece>& pieces, F&& parts) {
  std::vector<Piece> out;
  for (Piece& p : pieces) {
    bool first = p.first;
    for (auto [s, e] : parts(p)) {
      out.push_back({p.text.substr(s, e - s), first && s == 0});
    }
  }
  pieces = std::move(out);
}

struct PreTokenizers {
  std::vector<PreTokenize> steps;
  bool byte_level = false;  // ends with ByteLevel: the model works on bytes
};

void parse_pre_tokenizer(const Fields& f, PreTokenizers& out) {
  const std::string type = f.string("type");
  MESHTRAIN_CHECK(!out.byte_level, "{}: \"{}\" after ByteLevel is not implemented (ByteLevel "
                  "must be the last pre-tokenizer)", f.where, type);
  if (type == "Sequence") {
    const json& list = f.at("pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_pre_tokenizer(f.child(list[i], fmt::format("pretokenizers[{}]", i)), out);
    }
    return;
  }
  if (type == "ByteLevel") {
    out.byte_level = true;
    const bool prefix = f.boolean("add_prefix_space", true);
    const bool use_regex = f.boolean("use_regex", true);
    auto regex = use_regex ? std::make_shared<Pattern>(std::make_shared<Regex>(kByteLevelPattern, f.where))
                           : nullptr;
    out.steps.push_back([prefix, regex](std::vector<Piece>& pieces) {
      split_each(pieces, [&](Piece& p) {
        if (prefix && !p.text.empty() && p.text[0] != ' ') p.text.insert(0, " ");
        if (!regex) return std::vector<std::pair<size_t, size_t>>{{0, p.text.size()}};
        return split_ranges(regex->pieces(p.text, false), Behavior::isolated);
      });
    });
    return;
  }
  if (type == "Split") {
    auto pattern = std::make_shared<Pattern>(f);
    const Behavior behavior = parse_behavior(f);
    const bool invert = f.boolean("invert", false);
    out.steps.push_back([pattern, behavior, invert](std::vector<Piece>& pieces) {
      split_each(pieces, [&](Piece& p) { return split_ranges(pattern->pieces(p.text, invert), behavior); });
    });
    return;
  }
  if (type == "Digits") {
    // Rust's char::is_numeric: the N categories, one match per character.
    auto digit = std::make_shared<Pattern>(std::make_shared<Regex>(R"(\p{N})", f.where));
    const Behavior behavior =
        f.boolean("individual_digits", false) ? Behavior::isolated : Behavior::contiguous;
    out.steps.push_back([digit, behavior](std::vector<Piece>& pieces) {
      split_each(pieces, [&](Piece& p) { return split_ranges(digit->pieces(p.text, false), behavior); });
    });
    return;
  }
  if (type == "Metaspace") {
    const std::string replacement = f.string("replacement");
    MESHTRAIN_CHECK(!replacement.empty(), "{}: empty \"replacement\"", f.where);
    std::string scheme = "always";
    if (f.j.contains("prepend_scheme")) {
      scheme = f.string("prepend_scheme");
    } else if (f.j.contains("add_prefix_space")) {
      scheme = f.boolean("add_prefix_space", true) ? "always" : "never";
    }
    MESHTRAIN_CHECK(scheme == "always" || scheme == "first" || scheme == "never",
                    "{}: \"prepend_scheme\" \"{}\" is not always, first or never", f.where, scheme);
    const bool split = f.boolean("split", true);
    auto sep = std::make_shared<Pattern>(Pattern::literal(replacement));
    out.steps.push_back([replacement, scheme, split, sep](std::vector<Piece>& pieces) {
      split_each(pieces, [&](Piece& p) {
        std::string text;
        for (char c : p.text) {
          if (c == ' ') {
            text += replacement;
          } else {
            text.push_back(c);
          }
        }
        const bool starts = text.compare(0, replacement.size(), replacement) == 0;
        if (!text.empty() && !starts && (scheme == "always" || (scheme == "first" && p.first))) {
          text.insert(0, replacement);
        }
        p.text = std::move(text);
        if (!split) return std::vector<std::pair<size_t, size_t>>{{0, p.text.size()}};
        return split_ranges(sep->pieces(p.text, false), Behavior::merged_with_next);
      });
    });
    return;
  }
  fail("{}: pre-tokenizer \"{}\" is not implemented (ByteLevel, Split, Digits, Metaspace, "
       "Sequence)", f.where, type);
}

// ---- decoders -------------------------------------------------------------------

using Decode = std::function<void(std::vector<std::string>&)>;

Decode parse_decoder(const Fields& f, bool byte_level_vocab) {
  const std::string type = f.string("type");
  if (type == "Sequence") {
    std::vector<Decode> steps;
    const json& list = f.at("decoders");
    for (size_t i = 0; i < list.size(); ++i) {
      steps.push_back(parse_decoder(f.child(list[i], fmt::format("decoders[{}]", i)), byte_level_vocab));
    }
    return [steps](std::vector<std::string>& tokens) {
      for (const Decode& d : steps) d(tokens);
    };
  }
  if (type == "ByteLevel") {
    // The vocabulary is held as bytes already (BpeModel); nothing to map back.
    MESHTRAIN_CHECK(byte_level_vocab, "{}: a ByteLevel decoder without the ByteLevel "
                    "pre-tokenizer is not implemented", f.where);
    return [](std::vector<std::string>&) {};
  }
  if (type == "Replace") {
    auto pattern = std::make_shared<Pattern>(f);
    const std::string content = f.string("content");
    return [pattern, content](std::vector<std::string>& tokens) {
      for (std::string& t : tokens) t = pattern->replace_all(t, content);
    };
  }
  if (type == "ByteFallback") {
    // <0xXX> tokens become their byte.
    return [](std::vector<std::string>& tokens) {
      for (std::string& t : tokens) {
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
            std::isxdigit(static_cast<unsigned char>(t[3])) &&
            std::isxdigit(static_cast<unsigned char>(t[4]))) {
          t = std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
        }
      }
    };
  }
  if (type == "Fuse") {
    return [](std::vector<std::string>& tokens) {
      std::string all;
      for (const std::string& t : tokens) all += t;
      tokens = {all};
    };
  }
  if (type == "Strip") {
    const std::string content = f.string("content");
    const int64_t start = f.integer("start"), stop = f.integer("stop");
    return [content, start, stop](std::vector<std::string>& tokens) {
      for (std::string& t : tokens) {
        for (int64_t i = 0; i < start && t.compare(0, content.size(), content) == 0; ++i) {
          t.erase(0, content.size());
        }
        for (int64_t i = 0; i < stop && t.size() >= content.size() &&
                            t.compare(t.size() - content.size(), content.size(), content) == 0;
             ++i) {
          t.resize(t.size() - content.size());
        }
      }
    };
  }
  if (type == "Metaspace") {
    const std::string replacement = f.string("replacement");
    std::string scheme = "always";
    if (f.j.contains("prepend_scheme")) scheme = f.string("prepend_scheme");
    const bool strip_first = scheme != "never";
    auto pattern = std::make_shared<Pattern>(Pattern::literal(replacement));
    return [pattern, strip_first](std::vector<std::string>& tokens) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string t = pattern->replace_all(tokens[i], " ");
        if (i == 0 && strip_first && !t.empty() && t[0] == ' ') t.erase(0, 1);
        tokens[i] = std::move(t);
      }
    };
  }
  fail("{}: decoder \"{}\" is not implemented (ByteLevel, Metaspace, Replace, ByteFallback, "
       "Fuse, Strip, Sequence)", f.where, type);
}

// ---- the BPE model ----------------------------------------------------------------

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// The pieces one encode call has merged already: piece -> (first, count) in ids.
struct EncodeCache {
  StringMap<std::pair<uint32_t, uint32_t>> spans;
  std::vector<int32_t> ids, scratch;
};
constexpr size_t kCachedPieceBytes = 256, kCacheMaxIds = size_t{1} << 20;

struct BpeModel {
  // A symbol sequence for byte-level vocabularies is the piece's bytes (each
  // token held as the bytes its ByteLevel text stands for); otherwise its
  // UTF-8 characters.
  bool byte_level = false;
  StringMap<int32_t> vocab;  // token (bytes when byte_level) -> id
  // Tokens of a byte-level vocabulary written outside the ByteLevel alphabet:
  // no text maps to them; id -> their text, for decoding.
  std::vector<std::pair<int32_t, std::string>> unreachable;
  std::array<int32_t, 256> byte_ids{};              // byte_level: each byte's token; -1: none
  std::array<int32_t, 256> fallback_ids{};          // <0xXX> tokens; -1: none
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges;
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk = -1;

  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  // The initial symbols of `piece`: (id, -) per character, byte fallback, unk.
  void symbols(std::string_view piece, std::vector<int32_t>& out) const {
    bool last_unk = false;
    for (size_t i = 0; i < piece.size();) {
      const size_t n = byte_level ? 1 : char_length(piece, i);
      const std::string_view c = piece.substr(i, n);
      i += n;
      int32_t id = -1;
      if (byte_level) {
        id = byte_ids[static_cast<unsigned char>(c[0])];
      } else if (auto it = vocab.find(c); it != vocab.end()) {
        id = it->second;
      }
      if (id >= 0) {
        out.push_back(id);
        last_unk = false;
        continue;
      }
      if (byte_fallback && std::all_of(c.begin(), c.end(), [&](char b) {
            return fallback_ids[static_cast<unsigned char>(b)] >= 0;
          })) {
        for (char b : c) out.push_back(fallback_ids[static_cast<unsigned char>(b)]);
        continue;
      }
      if (unk < 0) continue;  // no token and no unk_token: dropped, as tokenizers does
      if (!(fuse_unk && last_unk)) out.push_back(unk);
      last_unk = true;
    }
  }

  // tokenizers' Word::merge_all: the lowest (rank, position) merge first.
  void merge(std::vector<int32_t>& sym, std::vector<int32_t>& ids) const {
    const size_t n = sym.size();
    if (n > 1) {
      std::vector<uint32_t> next(n), prev(n);
      for (size_t i = 0; i < n; ++i) {
        next[i] = static_cast<uint32_t>(i + 1);
        prev[i] = i == 0 ? kNone : static_cast<uint32_t>(i - 1);
      }
      struct Entry {
        uint32_t rank, pos;
        int32_t id;
        bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
      };
      std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
      auto push = [&](uint32_t pos) {
        const uint32_t nx = next[pos];
        if (nx >= n) return;
        auto it = merges.find(key(sym[pos], sym[nx]));
        if (it != merges.end()) heap.push({it->second.first, pos, it->second.second});
      };
      for (uint32_t i = 0; i + 1 < n; ++i) push(i);
      while (!heap.empty()) {
        const Entry e = heap.top();
        heap.pop();
        if (sym[e.pos] < 0 || next[e.pos] >= n) continue;  // removed, or the last symbol
        auto it = merges.find(key(sym[e.pos], sym[next[e.pos]]));
        if (it == merges.end() || it->second.second != e.id) continue;  // stale
        const uint32_t right = next[e.pos];
        sym[e.pos] = e.id;
        sym[right] = -1;
        next[e.pos] = next[right];
        if (next[right] < n) prev[next[right]] = e.pos;
        if (prev[e.pos] != kNone) push(prev[e.pos]);
        push(e.pos);
      }
    }
    for (int32_t s : sym) {
      if (s >= 0) ids.push_back(s);
    }
  }

  void encode(std::string_view piece, std::vector<int32_t>& ids, EncodeCache& cache) const {
    if (ignore_merges) {
      if (auto it = vocab.find(piece); it != vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    if (auto it = cache.spans.find(piece); it != cache.spans.end()) {
      const auto [first, count] = it->second;
      ids.insert(ids.end(), cache.ids.begin() + first, cache.ids.begin() + first + count);
      return;
    }
    const size_t before = ids.size();
    cache.scratch.clear();
    symbols(piece, cache.scratch);
    merge(cache.scratch, ids);
    if (piece.size() > kCachedPieceBytes) return;  // long pieces rarely repeat
    if (cache.ids.size() > kCacheMaxIds) {
      cache.ids.clear();
      cache.spans.clear();
    }
    const auto first = static_cast<uint32_t>(cache.ids.size());
    cache.ids.insert(cache.ids.end(), ids.begin() + static_cast<std::ptrdiff_t>(before), ids.end());
    cache.spans.emplace(std::string(piece), std::pair{first, static_cast<uint32_t>(ids.size() - before)});
  }
};

std::string fallback_name(int b) { return fmt::format("<0x{:02X}>", b); }

BpeModel parse_model(const Fields& f, bool byte_level) {
  const std::string type = f.string("type");
  MESHTRAIN_CHECK(type == "BPE", "{}: model type \"{}\" is not implemented (BPE; SentencePiece "
                  "Unigram models load from their tokenizer.model)", f.where, type);
  f.require_null("dropout", "BPE dropout");
  f.require_null("continuing_subword_prefix", "no tokenizer of today's families uses it");
  f.require_null("end_of_word_suffix", "no tokenizer of today's families uses it");
  BpeModel m;
  m.byte_level = byte_level;
  m.ignore_merges = f.boolean("ignore_merges", false);
  m.byte_fallback = f.boolean("byte_fallback", false);
  m.fuse_unk = f.boolean("fuse_unk", false);
  const json& vocab = f.at("vocab");
  MESHTRAIN_CHECK(vocab.is_object(), "{}: \"vocab\" must be an object", f.where);
  m.byte_ids.fill(-1);
  m.fallback_ids.fill(-1);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    MESHTRAIN_CHECK(it.value().is_number_integer() && it.value().get<int64_t>() >= 0 &&
                        it.value().get<int64_t>() < (int64_t{1} << 31),
                    "{}: vocab \"{}\" must have a non-negative id", f.where, it.key());
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    std::string token = it.key();
    if (byte_level) {
      // Tokens outside the ByteLevel alphabet cannot come out of it.
      std::optional<std::string> bytes = from_byte_level(token);
      if (!bytes) {
        m.unreachable.emplace_back(id, token);
        continue;
      }
      token = *bytes;
      if (token.size() == 1) m.byte_ids[static_cast<unsigned char>(token[0])] = id;
    }
    m.vocab.emplace(std::move(token), id);
  }
  for (int b = 0; b < 256 && m.byte_fallback; ++b) {
    if (auto it = m.vocab.find(fallback_name(b)); it != m.vocab.end()) m.fallback_ids[static_cast<size_t>(b)] = it->second;
  }
  if (f.j.contains("unk_token") && !f.j.at("unk_token").is_null()) {
    const std::string unk = f.string("unk_token");
    auto it = m.vocab.find(unk);
    MESHTRAIN_CHECK(it != m.vocab.end(), "{}: unk_token \"{}\" is not in the vocabulary", f.where, unk);
    m.unk = it->second;
  }
  const json& merges = f.at("merges");
  MESHTRAIN_CHECK(merges.is_array(), "{}: \"merges\" must be a list", f.where);
  m.merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& entry = merges[rank];
    std::string a, b;
    if (entry.is_string()) {
      const std::string s = entry.get<std::string>();
      const size_t space = s.find(' ');
      MESHTRAIN_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                      "{}: merges[{}] \"{}\" is not two tokens separated by one space", f.where,
                      rank, s);
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else {
      MESHTRAIN_CHECK(entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
                          entry[1].is_string(),
                      "{}: merges[{}] must be \"a b\" or [\"a\", \"b\"]", f.where, rank);
      a = entry[0].get<std::string>();
      b = entry[1].get<std::string>();
    }
    if (byte_level) {
      std::optional<std::string> ab = from_byte_level(a), bb = from_byte_level(b);
      MESHTRAIN_CHECK(ab && bb, "{}: merges[{}] \"{} {}\" is outside the ByteLevel alphabet",
                      f.where, rank, a, b);
      a = *ab;
      b = *bb;
    }
    auto ia = m.vocab.find(a), ib = m.vocab.find(b), iab = m.vocab.find(a + b);
    MESHTRAIN_CHECK(ia != m.vocab.end() && ib != m.vocab.end() && iab != m.vocab.end(),
                    "{}: merges[{}] joins tokens that are not all in the vocabulary", f.where, rank);
    m.merges.try_emplace(BpeModel::key(ia->second, ib->second),
                         static_cast<uint32_t>(rank), iab->second);
  }
  return m;
}

// ---- added tokens -------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, normalized = false, single_word = false;
};

bool is_word_char(std::string_view text, size_t i, size_t n) {
  const uint32_t c = code_point(text, i, n);
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) != 0 || c == '_';
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat <= UTF8PROC_CATEGORY_LO || (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

// Added tokens matched leftmost-longest (tokenizers' aho-corasick
// LeftmostLongest), with their strip and single-word rules.
class AddedMatcher {
 public:
  void add(const AddedToken* t, std::string pattern) {
    if (pattern.empty()) return;
    by_first_[static_cast<unsigned char>(pattern[0])].push_back({std::move(pattern), t});
  }
  void finish() {
    for (auto& list : by_first_) {
      std::stable_sort(list.begin(), list.end(),
                       [](const Entry& a, const Entry& b) { return a.text.size() > b.text.size(); });
    }
  }
  bool empty() const {
    return std::all_of(by_first_.begin(), by_first_.end(), [](const auto& l) { return l.empty(); });
  }

  // Calls stretch(begin, end) for text between tokens and token(t) for each
  // token, in order; specials are text when `skip_special`.
  template <class Stretch, class Token>
  void split(std::string_view s, bool skip_special, Stretch&& stretch, Token&& token) const {
    size_t done = 0;
    for (size_t i = 0; i < s.size();) {
      const Entry* hit = nullptr;
      for (const Entry& e : by_first_[static_cast<unsigned char>(s[i])]) {
        if (s.compare(i, e.text.size(), e.text) == 0) {
          hit = &e;
          break;
        }
      }
      if (hit == nullptr) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + hit->text.size();
      const AddedToken& t = *hit->token;
      bool keep = !(skip_special && t.special);
      if (keep && t.single_word) {
        const bool before = start == 0 || !is_word_char(s, prev_char(s, start), start - prev_char(s, start));
        const bool after = stop == s.size() || !is_word_char(s, stop, char_length(s, stop));
        keep = before && after;
      }
      if (!keep) {
        i = stop;  // the automaton consumed it; no other token starts inside
        continue;
      }
      if (t.lstrip) {
        size_t b = start;
        while (b > done) {
          const size_t p = prev_char(s, b);
          if (!is_white_space(code_point(s, p, b - p))) break;
          b = p;
        }
        start = b;
      }
      if (t.rstrip) {
        while (stop < s.size()) {
          const size_t n = char_length(s, stop);
          if (!is_white_space(code_point(s, stop, n))) break;
          stop += n;
        }
      }
      if (start > done) stretch(done, start);
      token(t);
      done = i = stop;
    }
    if (done < s.size() || s.empty()) stretch(done, s.size());
  }

 private:
  static size_t prev_char(std::string_view s, size_t i) {
    size_t p = i - 1;
    while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80 && i - p < 4) --p;
    return char_length(s, p) == i - p ? p : i - 1;
  }
  struct Entry {
    std::string text;
    const AddedToken* token;
  };
  std::array<std::vector<Entry>, 256> by_first_;
};

}  // namespace

// ---- the tokenizer ----------------------------------------------------------------------

struct HfTokenizer::Impl {
  std::string source;
  Normalize normalize;  // empty: none
  PreTokenizers pre;
  BpeModel model;
  Decode decode_steps;  // empty: tokens joined
  std::vector<AddedToken> added;
  AddedMatcher raw, normalized;  // added tokens looked for before / after normalizing
  std::vector<std::string> id_to_token;  // model tokens (bytes when byte-level) and added ones
  DocumentFrame template_frame;  // the post-processor's single template around $A
  TokenizerConfig config;
  int32_t end_id = -1;
  std::vector<Tokenizer::File> files;

  void encode_stretch(std::string_view text, bool first, std::vector<int32_t>& ids,
                      EncodeCache& cache) const {
    std::string s(text);
    if (normalize) normalize(s);
    normalized.split(
        s, false,
        [&](size_t b, size_t e) {
          std::vector<Piece> pieces{{s.substr(b, e - b), first && b == 0}};
          for (const PreTokenize& step : pre.steps) step(pieces);
          for (const Piece& p : pieces) {
            if (!p.text.empty()) model.encode(p.text, ids, cache);
          }
        },
        [&](const AddedToken& t) { ids.push_back(t.id); });
  }

  void encode(std::string_view text, bool skip_special, std::vector<int32_t>& ids) const {
    EncodeCache cache;
    raw.split(
        text, skip_special,
        [&](size_t b, size_t e) { encode_stretch(text.substr(b, e - b), b == 0, ids, cache); },
        [&](const AddedToken& t) { ids.push_back(t.id); });
  }

  std::optional<int32_t> find(std::string_view token) const {
    for (const AddedToken& t : added) {
      if (t.content == token) return t.id;
    }
    std::string key(token);
    if (model.byte_level) {
      std::optional<std::string> bytes = from_byte_level(token);
      if (!bytes) {
        for (const auto& [id, text] : model.unreachable) {
          if (text == token) return id;
        }
        return std::nullopt;
      }
      key = *bytes;
    }
    if (auto it = model.vocab.find(key); it != model.vocab.end()) return it->second;
    return std::nullopt;
  }
};

namespace {

Tokenizer::DocumentFrame parse_post_processor(const Fields& f, const HfTokenizer::Impl& im) {
  const std::string type = f.string("type");
  Tokenizer::DocumentFrame frame;
  if (type == "ByteLevel") return frame;
  if (type == "Sequence") {
    const json& list = f.at("processors");
    for (size_t i = 0; i < list.size(); ++i) {
      Tokenizer::DocumentFrame part = parse_post_processor(f.child(list[i], fmt::format("processors[{}]", i)), im);
      frame.before.insert(frame.before.end(), part.before.begin(), part.before.end());
      frame.after.insert(frame.after.end(), part.after.begin(), part.after.end());
    }
    return frame;
  }
  MESHTRAIN_CHECK(type == "TemplateProcessing", "{}: post-processor \"{}\" is not implemented "
                  "(TemplateProcessing, ByteLevel, Sequence)", f.where, type);
  const json& specials = f.at("special_tokens");
  bool seen_sequence = false;
  for (const json& item : f.at("single")) {
    if (item.contains("Sequence")) {
      MESHTRAIN_CHECK(item["Sequence"].value("id", "") == "A", "{}: single template: only "
                      "sequence $A is implemented", f.where);
      seen_sequence = true;
      continue;
    }
    MESHTRAIN_CHECK(item.contains("SpecialToken"), "{}: single template items must be "
                    "SpecialToken or Sequence", f.where);
    const std::string name = item["SpecialToken"].value("id", "");
    MESHTRAIN_CHECK(specials.contains(name), "{}: special token \"{}\" of the template is not in "
                    "special_tokens", f.where, name);
    std::vector<int32_t>& side = seen_sequence ? frame.after : frame.before;
    for (const json& id : specials[name].at("ids")) {
      MESHTRAIN_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                          id.get<int64_t>() < static_cast<int64_t>(im.id_to_token.size()),
                      "{}: special token \"{}\" has id {} outside the vocabulary", f.where, name,
                      id.dump());
      side.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  return frame;
}

std::string token_name(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

}  // namespace

TokenizerConfig read_tokenizer_config(const std::string& path) {
  const std::string text = read_file_text(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("tokenizer config '{}': not JSON: {}", path, e.what());
  }
  TokenizerConfig c;
  for (auto [key, field] : {std::pair{"bos_token", &c.bos_token}, {"eos_token", &c.eos_token}}) {
    if (j.contains(key) && !j[key].is_null()) {
      const std::string name = token_name(j[key]);
      MESHTRAIN_CHECK(!name.empty(), "tokenizer config '{}': \"{}\" must be a string or "
                      "{{\"content\": ...}}", path, key);
      *field = name;
    }
  }
  if (j.contains("chat_template") && !j["chat_template"].is_null()) {
    const json& t = j["chat_template"];
    if (t.is_string()) {
      c.chat_template = t.get<std::string>();
    } else {
      // A list of named templates: the "default" one.
      MESHTRAIN_CHECK(t.is_array(), "tokenizer config '{}': \"chat_template\" must be a string "
                      "or a list of {{name, template}}", path);
      for (const json& named : t) {
        if (named.value("name", "") == "default") c.chat_template = named.value("template", "");
      }
      MESHTRAIN_CHECK(!c.chat_template.empty(), "tokenizer config '{}': \"chat_template\" has no "
                      "\"default\" template", path);
    }
  }
  return c;
}

std::unique_ptr<HfTokenizer> HfTokenizer::load(const std::string& path, TokenizerConfig config,
                                               std::vector<File> files) {
  auto t = from_json(read_file_text(path), path, std::move(config));
  t->impl_->files = files.empty() ? std::vector<File>{{path, "tokenizer.json"}} : std::move(files);
  return t;
}

namespace {
std::unique_ptr<HfTokenizer::Impl> parse_tokenizer(std::string_view text, const std::string& source,
                                                   TokenizerConfig config);
}  // namespace

std::unique_ptr<HfTokenizer> HfTokenizer::from_json(std::string_view text, const std::string& source,
                                                    TokenizerConfig config) {
  try {
    return std::unique_ptr<HfTokenizer>(new HfTokenizer(parse_tokenizer(text, source, std::move(config))));
  } catch (const json::exception& e) {  // a field of the wrong shape the checks did not name
    fail("tokenizer '{}': malformed: {}", source, e.what());
  }
}

namespace {
std::unique_ptr<HfTokenizer::Impl> parse_tokenizer(std::string_view text, const std::string& source,
                                                   TokenizerConfig config) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("tokenizer '{}': not JSON: {}", source, e.what());
  }
  auto im = std::make_unique<HfTokenizer::Impl>();
  im->source = source;
  im->config = std::move(config);
  const Fields root{j, fmt::format("tokenizer '{}'", source)};
  // "truncation" and "padding" act on batches of encodings, not on the ids
  // of a text: meshtrain cuts and packs sequences itself.
  if (!root.at("normalizer").is_null()) im->normalize = parse_normalizer(root.child(j["normalizer"], "normalizer"));
  if (!root.at("pre_tokenizer").is_null()) parse_pre_tokenizer(root.child(j["pre_tokenizer"], "pre_tokenizer"), im->pre);
  im->model = parse_model(root.child(root.at("model"), "model"), im->pre.byte_level);
  if (!root.at("decoder").is_null()) im->decode_steps = parse_decoder(root.child(j["decoder"], "decoder"), im->pre.byte_level);

  // Every id's text: the model's tokens, then the added ones.
  int64_t size = 0;
  for (const auto& [token, id] : im->model.vocab) size = std::max<int64_t>(size, id + 1);
  for (const auto& [id, token] : im->model.unreachable) size = std::max<int64_t>(size, id + 1);
  const json& added = root.at("added_tokens");
  for (size_t i = 0; i < added.size(); ++i) {
    const Fields a = root.child(added[i], fmt::format("added_tokens[{}]", i));
    AddedToken t;
    const int64_t id = a.integer("id");
    MESHTRAIN_CHECK(id >= 0 && id < (int64_t{1} << 31), "{}: id {} out of range", a.where, id);
    t.id = static_cast<int32_t>(id);
    t.content = a.string("content");
    t.special = a.boolean("special", false);
    t.lstrip = a.boolean("lstrip", false);
    t.rstrip = a.boolean("rstrip", false);
    t.normalized = a.boolean("normalized", !t.special);
    t.single_word = a.boolean("single_word", false);
    size = std::max<int64_t>(size, id + 1);
    im->added.push_back(std::move(t));
  }
  MESHTRAIN_CHECK(size > 0, "tokenizer '{}': empty vocabulary", source);
  // Ids are (nearly) dense in every real vocabulary; a far id is a broken file.
  const auto tokens = static_cast<int64_t>(im->model.vocab.size() + im->model.unreachable.size() +
                                           im->added.size());
  MESHTRAIN_CHECK(size - tokens <= 65536, "tokenizer '{}': ids reach {} for {} tokens (more than "
                  "65536 ids without a token)", source, size - 1, tokens);
  im->id_to_token.assign(static_cast<size_t>(size), std::string());
  for (const auto& [token, id] : im->model.vocab) im->id_to_token[static_cast<size_t>(id)] = token;
  for (const auto& [id, token] : im->model.unreachable) im->id_to_token[static_cast<size_t>(id)] = token;
  for (const AddedToken& t : im->added) {
    im->id_to_token[static_cast<size_t>(t.id)] = t.content;
  }
  for (const AddedToken& t : im->added) {
    if (t.normalized) {
      std::string content = t.content;
      if (im->normalize) im->normalize(content);
      im->normalized.add(&t, content);
    } else {
      im->raw.add(&t, t.content);
    }
  }
  im->raw.finish();
  im->normalized.finish();
  if (!root.at("post_processor").is_null()) {
    im->template_frame = parse_post_processor(root.child(j["post_processor"], "post_processor"), *im);
  }
  // The end of a sequence: the config's eos, else the template's last special, else its first.
  if (im->config.eos_token) {
    std::optional<int32_t> eos = im->find(*im->config.eos_token);
    MESHTRAIN_CHECK(eos.has_value(), "tokenizer '{}': eos_token \"{}\" (tokenizer_config.json) is "
                    "not a token", source, *im->config.eos_token);
    im->end_id = *eos;
  } else if (!im->template_frame.after.empty()) {
    im->end_id = im->template_frame.after.back();
  } else if (!im->template_frame.before.empty()) {
    im->end_id = im->template_frame.before.front();
  }
  return im;
}
}  // namespace

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

std::string HfTokenizer::name() const { return impl_->source; }
int64_t HfTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

int32_t HfTokenizer::eot_id() const {
  MESHTRAIN_CHECK(impl_->end_id >= 0, "tokenizer '{}': no end-of-sequence token (give "
                  "tokenizer_config.json's eos_token)", impl_->source);
  return impl_->end_id;
}

void HfTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const {
  impl_->encode(text, true, ids);
}

void HfTokenizer::encode(std::string_view text, std::vector<int32_t>& ids, bool add_special) const {
  const DocumentFrame& f = impl_->template_frame;
  if (add_special) ids.insert(ids.end(), f.before.begin(), f.before.end());
  impl_->encode(text, false, ids);
  if (add_special) ids.insert(ids.end(), f.after.begin(), f.after.end());
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const {
  const Impl& im = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    MESHTRAIN_CHECK(id >= 0 && id < vocab_size(), "tokenizer '{}': cannot decode id {}: outside "
                    "the vocabulary of {} ids", im.source, id, vocab_size());
    tokens.push_back(im.id_to_token[static_cast<size_t>(id)]);
  }
  std::string out;
  if (!im.decode_steps) {  // tokenizers joins the tokens with spaces
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  im.decode_steps(tokens);
  for (const std::string& t : tokens) out += t;
  return out;
}

std::optional<int32_t> HfTokenizer::token_id(std::string_view token) const { return impl_->find(token); }

bool HfTokenizer::is_special(int32_t id) const {
  return std::ranges::any_of(impl_->added, [id](const AddedToken& t) { return t.id == id && t.special; });
}

std::string HfTokenizer::token_text(int32_t id) const {
  // Decoded after a plain token, so that the decoders' first-token rules
  // (Metaspace and Strip dropping a leading space) apply to that one.
  const std::optional<int32_t> anchor = impl_->find("a");
  if (!anchor) return Tokenizer::token_text(id);
  const std::array<int32_t, 2> pair{*anchor, id};
  const std::string head = decode(std::span(pair).first(1)), both = decode(pair);
  return both.starts_with(head) ? both.substr(head.size()) : Tokenizer::token_text(id);
}

const TokenizerConfig& HfTokenizer::config() const { return impl_->config; }

Tokenizer::DocumentFrame HfTokenizer::document_frame() const {
  // The post-processor's BOS / EOS; when it adds none, the end-of-sequence
  // token after each document (Qwen, GPT-2).
  DocumentFrame f = impl_->template_frame;
  if (f.before.empty() && f.after.empty()) f.after.push_back(eot_id());
  return f;
}

std::vector<Tokenizer::File> HfTokenizer::files() const { return impl_->files; }

}  // namespace meshtrain
