#include "meshtrain/data/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR message[256];
  pcre2_get_error_message(code, message, sizeof message);
  return reinterpret_cast<const char*>(message);
}

}  // namespace

Regex::Regex(std::string_view pattern, std::string_view what)
    : pattern_(pattern), what_(what) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
  MESHTRAIN_CHECK(code_ != nullptr, "{}: PCRE2 cannot compile the pattern '{}' at offset {}: {}",
                  what, pattern, offset, pcre2_message(error));
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(code_); }

Regex::Scratch::Scratch(const Regex& regex)
    : data_(pcre2_match_data_create_from_pattern(regex.code_, nullptr)) {
  MESHTRAIN_CHECK(data_ != nullptr, "tokenizer: out of memory for PCRE2 match data");
}

Regex::Scratch::~Scratch() { pcre2_match_data_free(data_); }

Regex::Match Regex::find(std::string_view text, size_t from, Scratch& scratch) const {
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = jit_ ? pcre2_jit_match(code_, subject, text.size(), from, 0, scratch.data_, nullptr)
                      : pcre2_match(code_, subject, text.size(), from, 0, scratch.data_, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return {};
  MESHTRAIN_CHECK(rc >= 0, "{}: PCRE2 match failed at byte {}: {}", what_, from, pcre2_message(rc));
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.data_);
  return {ovector[0], ovector[1]};
}

}  // namespace meshtrain
