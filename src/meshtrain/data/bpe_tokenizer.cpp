#include "meshtrain/data/bpe_tokenizer.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "meshtrain/data/regex.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/rng.h"

namespace meshtrain {
namespace {

constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();
// Pieces longer than this merge with a heap instead of tiktoken's quadratic
// scan (same result: both take the lowest (rank, position) pair each step).
constexpr size_t kHeapMergeFrom = 128;
// Bound on the per-call cache of multi-token pieces (ids stored).
constexpr size_t kCacheMaxIds = size_t{1} << 20;

uint64_t hash_bytes(std::string_view s) {
  uint64_t h = s.size() * 0x9e3779b97f4a7c15ull;
  const char* p = s.data();
  size_t n = s.size();
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  if (n > 0) {
    uint64_t v = 0;
    std::memcpy(&v, p, n);
    h = (h ^ v) * 0xc4ceb9fe1a85ec53ull;
  }
  return mix64(h);
}

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Strict standard base64 (padded); false on any defect.
bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  size_t pad = 0;
  if (in.back() == '=') pad = (in[in.size() - 2] == '=') ? 2 : 1;
  for (size_t i = 0; i < in.size(); i += 4) {
    uint32_t v = 0;
    for (size_t j = 0; j < 4; ++j) {
      char c = in[i + j];
      bool last_quad = i + 4 == in.size();
      int d = (c == '=' && last_quad && j >= 4 - pad) ? 0 : base64_value(c);
      if (d < 0) return false;
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    size_t keep = (i + 4 == in.size()) ? 3 - pad : 3;
    for (size_t j = 0; j < keep; ++j) out.push_back(static_cast<char>((v >> (16 - 8 * j)) & 0xff));
  }
  return true;
}

struct TransparentHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return hash_bytes(s); }
};

// Multi-token pieces seen in one encode call, piece -> (first, count) in ids.
struct PieceCache {
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, TransparentHash,
                     std::equal_to<>>
      spans;
  std::vector<int32_t> ids;
};

struct Part {
  uint32_t start;
  uint32_t rank;  // of this part merged with the next one
};

}  // namespace

struct BpeTokenizer::Impl {
  std::string arena;               // token bytes, concatenated by rank
  std::vector<uint32_t> offsets;   // token r is arena[offsets[r], offsets[r+1])
  // Open addressing, linear probing. A slot holds a rank (-1: empty) and the
  // high half of its hash, so most mismatches skip the byte comparison.
  struct Slot {
    uint32_t tag;
    int32_t rank;
  };
  std::vector<Slot> slots;
  uint64_t slot_mask = 0;
  Regex regex{kGpt2Pattern, "tokenizer gpt2"};

  int32_t num_ranks() const { return static_cast<int32_t>(offsets.size()) - 1; }

  std::string_view bytes_of(int32_t rank) const {
    return {arena.data() + offsets[rank], offsets[rank + 1] - offsets[rank]};
  }

  // Rank of exactly these bytes, or -1.
  int32_t find(std::string_view s) const {
    uint64_t h = hash_bytes(s);
    auto tag = static_cast<uint32_t>(h >> 32);
    for (uint64_t i = h & slot_mask;; i = (i + 1) & slot_mask) {
      Slot slot = slots[i];
      if (slot.rank < 0) return -1;
      if (slot.tag == tag && bytes_of(slot.rank) == s) return slot.rank;
    }
  }

  uint32_t rank_of(std::string_view piece, size_t begin, size_t end) const {
    int32_t r = find(piece.substr(begin, end - begin));
    return r < 0 ? kNoRank : static_cast<uint32_t>(r);
  }

  void merge_small(std::string_view piece, std::vector<Part>& parts,
                   std::vector<int32_t>& out) const;
  void merge_large(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, PieceCache& cache, std::vector<Part>& parts,
                    std::vector<int32_t>& ids) const;
};

// tiktoken's byte_pair_merge: merge the leftmost lowest-ranked pair until none is a token.
void BpeTokenizer::Impl::merge_small(std::string_view piece, std::vector<Part>& parts,
                                     std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  parts.clear();
  for (size_t i = 0; i + 1 < n; ++i) parts.push_back({uint32_t(i), rank_of(piece, i, i + 2)});
  parts.push_back({uint32_t(n - 1), kNoRank});
  parts.push_back({uint32_t(n), kNoRank});
  auto rank_after_merge = [&](size_t i) {
    return i + 3 < parts.size() ? rank_of(piece, parts[i].start, parts[i + 3].start) : kNoRank;
  };
  for (;;) {
    uint32_t best = kNoRank;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (parts[i].rank < best) {
        best = parts[i].rank;
        at = i;
      }
    }
    if (best == kNoRank) break;
    if (at > 0) parts[at - 1].rank = rank_after_merge(at - 1);
    parts[at].rank = rank_after_merge(at);
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    out.push_back(static_cast<int32_t>(rank_of(piece, parts[i].start, parts[i + 1].start)));
  }
}

// The same merges in O(n log n): a doubly linked list of parts and a min-heap
// of (rank, start) with stale entries skipped by a per-part version.
void BpeTokenizer::Impl::merge_large(std::string_view piece, std::vector<int32_t>& out) const {
  const uint32_t n = static_cast<uint32_t>(piece.size());
  std::vector<uint32_t> next(n), prev(n), version(n, 0);
  std::vector<uint32_t> rank(n, kNoRank);  // of the part starting at i merged with its successor
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;  // wraps for i == 0; never read there
  }
  struct Entry {
    uint32_t rank, start, version;
    bool operator>(const Entry& o) const {
      return rank != o.rank ? rank > o.rank : start > o.start;
    }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  auto pair_rank = [&](uint32_t i) {
    uint32_t j = next[i];
    if (j >= n) return kNoRank;
    return rank_of(piece, i, next[j] >= n ? n : next[j]);
  };
  for (uint32_t i = 0; i + 1 < n; ++i) {
    rank[i] = rank_of(piece, i, i + 2);
    if (rank[i] != kNoRank) heap.push({rank[i], i, 0});
  }
  while (!heap.empty()) {
    Entry e = heap.top();
    heap.pop();
    if (e.version != version[e.start] || rank[e.start] != e.rank) continue;
    uint32_t i = e.start, j = next[i];
    next[i] = next[j];  // part j joins part i
    if (next[i] < n) prev[next[i]] = i;
    version[j] = kNoRank;  // j is gone
    rank[i] = pair_rank(i);
    ++version[i];
    if (rank[i] != kNoRank) heap.push({rank[i], i, version[i]});
    if (i > 0) {
      uint32_t p = prev[i];
      rank[p] = pair_rank(p);
      ++version[p];
      if (rank[p] != kNoRank) heap.push({rank[p], p, version[p]});
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) {
    out.push_back(static_cast<int32_t>(rank_of(piece, i, std::min(next[i], n))));
  }
}

void BpeTokenizer::Impl::encode_piece(std::string_view piece, PieceCache& cache,
                                      std::vector<Part>& parts, std::vector<int32_t>& ids) const {
  if (int32_t r = find(piece); r >= 0) {
    ids.push_back(r);
    return;
  }
  if (auto it = cache.spans.find(piece); it != cache.spans.end()) {
    auto [first, count] = it->second;
    ids.insert(ids.end(), cache.ids.begin() + first, cache.ids.begin() + first + count);
    return;
  }
  size_t before = ids.size();
  if (piece.size() < kHeapMergeFrom) {
    merge_small(piece, parts, ids);
  } else {
    merge_large(piece, ids);
    return;  // long pieces rarely repeat
  }
  if (cache.ids.size() > kCacheMaxIds) {
    cache.ids.clear();
    cache.spans.clear();
  }
  auto first = static_cast<uint32_t>(cache.ids.size());
  cache.ids.insert(cache.ids.end(), ids.begin() + static_cast<std::ptrdiff_t>(before), ids.end());
  cache.spans.emplace(std::string(piece),
                      std::pair{first, static_cast<uint32_t>(ids.size() - before)});
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::~BpeTokenizer() = default;

std::unique_ptr<BpeTokenizer> BpeTokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK(in.good(), "ranks file '{}': cannot open (run scripts/get_gpt2_ranks.sh, or "
                  "point the tokenizer at a gpt2.tiktoken file)", path);
  std::ostringstream text;
  text << in.rdbuf();
  MESHTRAIN_CHECK(!in.bad(), "ranks file '{}': read error", path);
  return from_ranks_text(text.str(), path);
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_ranks_text(std::string_view text,
                                                            const std::string& source) {
  auto impl = std::make_unique<Impl>();
  // The non-empty lines (tiktoken skips blank ones), each "<base64> <rank>".
  std::vector<std::pair<size_t, std::string_view>> lines;
  for (size_t pos = 0, line_no = 1; pos < text.size(); ++line_no) {
    size_t end = std::min(text.find('\n', pos), text.size());
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty()) lines.emplace_back(line_no, line);
  }
  MESHTRAIN_CHECK(!lines.empty(), "ranks file '{}': no tokens", source);
  // Ranks are 0..N-1 for N lines, each once.
  std::vector<std::string> tokens(lines.size());
  std::vector<size_t> line_of(lines.size(), 0);
  std::string bytes;
  for (auto [line_no, line] : lines) {
    size_t space = line.find(' ');
    MESHTRAIN_CHECK(space != std::string_view::npos && line.find(' ', space + 1) == line.npos,
                    "ranks file '{}' line {}: expected '<base64 token bytes> <rank>', got '{}'",
                    source, line_no, line.substr(0, 80));
    std::string_view b64 = line.substr(0, space), rank_text = line.substr(space + 1);
    MESHTRAIN_CHECK(base64_decode(b64, bytes), "ranks file '{}' line {}: '{}' is not base64",
                    source, line_no, b64.substr(0, 80));
    size_t rank = 0;
    bool digits = !rank_text.empty() && rank_text.size() <= 9;
    for (char c : rank_text) {
      digits = digits && c >= '0' && c <= '9';
      rank = rank * 10 + static_cast<size_t>(c - '0');
    }
    MESHTRAIN_CHECK(digits, "ranks file '{}' line {}: rank '{}' is not a non-negative integer",
                    source, line_no, rank_text.substr(0, 40));
    MESHTRAIN_CHECK(rank < lines.size(),
                    "ranks file '{}' line {}: rank {} out of range (ranks are 0..{}, one per line)",
                    source, line_no, rank, lines.size() - 1);
    MESHTRAIN_CHECK(line_of[rank] == 0, "ranks file '{}' line {}: rank {} already given on line {}",
                    source, line_no, rank, line_of[rank]);
    tokens[rank] = bytes;
    line_of[rank] = line_no;
  }

  impl->offsets.reserve(tokens.size() + 1);
  for (const auto& t : tokens) {
    impl->offsets.push_back(static_cast<uint32_t>(impl->arena.size()));
    impl->arena += t;
  }
  impl->offsets.push_back(static_cast<uint32_t>(impl->arena.size()));
  size_t capacity = 1024;
  while (capacity < 2 * tokens.size()) capacity *= 2;
  impl->slots.assign(capacity, Impl::Slot{0, -1});
  impl->slot_mask = capacity - 1;
  for (int32_t r = 0; r < impl->num_ranks(); ++r) {
    std::string_view b = impl->bytes_of(r);
    uint64_t h = hash_bytes(b);
    uint64_t i = h & impl->slot_mask;
    for (; impl->slots[i].rank >= 0; i = (i + 1) & impl->slot_mask) {
      int32_t other = impl->slots[i].rank;
      MESHTRAIN_CHECK(impl->bytes_of(other) != b,
                      "ranks file '{}' line {}: same token bytes as rank {} (line {})", source,
                      line_of[r], other, line_of[other]);
    }
    impl->slots[i] = {static_cast<uint32_t>(h >> 32), r};
  }
  for (int b = 0; b < 256; ++b) {
    char c = static_cast<char>(b);
    MESHTRAIN_CHECK(impl->find(std::string_view(&c, 1)) >= 0,
                    "ranks file '{}': byte 0x{:02x} has no token (byte-level BPE needs all 256)",
                    source, b);
  }

  return std::unique_ptr<BpeTokenizer>(new BpeTokenizer(std::move(impl)));
}

int64_t BpeTokenizer::vocab_size() const { return impl_->num_ranks() + 1; }
int32_t BpeTokenizer::eot_id() const { return impl_->num_ranks(); }

std::string_view BpeTokenizer::token_bytes(int32_t id) const {
  MESHTRAIN_CHECK(id >= 0 && id < impl_->num_ranks(), "tokenizer: {} is not an ordinary token id",
                  id);
  return impl_->bytes_of(id);
}

void BpeTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const {
  const Impl& im = *impl_;
  Regex::Scratch scratch(im.regex);
  PieceCache cache;
  std::vector<Part> parts;
  size_t pos = 0;
  while (pos < text.size()) {
    const Regex::Match m = im.regex.find(text, pos, scratch);
    const size_t start = m.found() ? m.start : text.size(), end = m.found() ? m.end : text.size();
    // Bytes the pattern skips (invalid UTF-8) are a piece of their own, so nothing is lost.
    if (start > pos) im.encode_piece(text.substr(pos, start - pos), cache, parts, ids);
    if (end > start) im.encode_piece(text.substr(start, end - start), cache, parts, ids);
    pos = std::max(end, pos + 1);
  }
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id == eot_id()) {
      out += kEndOfText;
    } else {
      MESHTRAIN_CHECK(id >= 0 && id < impl_->num_ranks(),
                      "tokenizer: cannot decode id {}: outside the vocabulary of {} ids", id,
                      vocab_size());
      out += impl_->bytes_of(id);
    }
  }
  return out;
}

}  // namespace meshtrain
