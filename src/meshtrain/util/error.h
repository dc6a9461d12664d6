// Error's formatting helpers: fail, fail_as and the MESHTRAIN_CHECK macros
// (the kinds and the class: util/error_kind.h).
#pragma once

#include <fmt/format.h>

#include <string>
#include <utility>

#include "meshtrain/util/error_kind.h"

namespace meshtrain {

// Throws Error of `kind` with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail_as(ErrorKind kind, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...), kind);
}

// Throws Error (kind config) with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Checks an invariant that user input can violate (config, files, shapes).
#define MESHTRAIN_CHECK(cond, ...)        \
  do {                                    \
    if (!(cond)) ::meshtrain::fail(__VA_ARGS__); \
  } while (0)

// The same for another kind: MESHTRAIN_CHECK_AS(ErrorKind::io, fd >= 0, "...", ...).
#define MESHTRAIN_CHECK_AS(kind, cond, ...)               \
  do {                                                    \
    if (!(cond)) ::meshtrain::fail_as(kind, __VA_ARGS__); \
  } while (0)

}  // namespace meshtrain
