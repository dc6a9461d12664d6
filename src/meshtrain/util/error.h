// Errors carry their context (file, field, tensor, rank) in the message; the
// CLI turns any Error into one line on stderr and a non-zero exit code.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace meshtrain {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Checks an invariant that user input can violate (config, files, shapes).
#define MESHTRAIN_CHECK(cond, ...)        \
  do {                                    \
    if (!(cond)) ::meshtrain::fail(__VA_ARGS__); \
  } while (0)

}  // namespace meshtrain
