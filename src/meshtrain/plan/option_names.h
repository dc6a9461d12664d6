// One table per option enum: its names in declaration order, for printing and
// parsing (unknown names throw Error listing the known ones).
#pragma once

#include <fmt/format.h>

#include <array>
#include <string_view>

#include "meshtrain/util/error.h"

namespace meshtrain::plan {

template <typename E, size_t N>
struct OptionNames {
  std::string_view option;
  std::array<std::string_view, N> names;

  std::string_view name(E value) const { return names[static_cast<size_t>(value)]; }
  E parse(std::string_view text) const {
    for (size_t i = 0; i < N; ++i) {
      if (names[i] == text) return static_cast<E>(i);
    }
    fail("plan: unknown {} '{}' (expected {})", option, text, fmt::join(names, ", "));
  }
};

}  // namespace meshtrain::plan
