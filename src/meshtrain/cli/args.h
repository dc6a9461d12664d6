// Command-line pieces shared by the subcommands: the usage error (exit code 2)
// and train's "--section.key value" config overrides.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/train/config.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

// Signals a command-line usage problem (exit code 2).
struct UsageError : Error {
  using Error::Error;
};

// "--section.key value" and "--section.key=value" pairs left over by CLI11.
ConfigOverrides parse_overrides(const std::vector<std::string>& args);

}  // namespace meshtrain
