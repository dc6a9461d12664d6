// A compiled PCRE2 pattern for tokenizers: UTF-8 with Unicode properties
// (\p{L}, \s as Unicode defines them), invalid UTF-8 in the subject tolerated
// (the bytes of a broken character never match), JIT-compiled when the
// platform allows. Immutable after construction: one instance may match on
// many threads at once, each with its own Regex::Scratch.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

struct pcre2_real_code_8;
struct pcre2_real_match_data_8;

namespace meshtrain {

class Regex {
 public:
  // Throws Error naming `what` (e.g. "tokenizer.json pre_tokenizer Split") and
  // the offset of a pattern PCRE2 cannot compile.
  Regex(std::string_view pattern, std::string_view what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  struct Match {
    size_t start = std::string_view::npos, end = std::string_view::npos;
    bool found() const { return start != std::string_view::npos; }
  };
  // Per-thread match state.
  class Scratch {
   public:
    explicit Scratch(const Regex& regex);
    ~Scratch();
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;

   private:
    friend class Regex;
    pcre2_real_match_data_8* data_;
  };

  // The leftmost match starting at or after byte `from`; not found() when none.
  Match find(std::string_view text, size_t from, Scratch& scratch) const;

  // Every non-overlapping non-empty match, left to right: f(start, end).
  template <class F>
  void for_each_match(std::string_view text, Scratch& scratch, F&& f) const {
    for (size_t pos = 0; pos < text.size();) {
      const Match m = find(text, pos, scratch);
      if (!m.found()) return;
      if (m.end > m.start) f(m.start, m.end);
      pos = m.end > m.start ? m.end : m.start + 1;
    }
  }

  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_, what_;
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace meshtrain
