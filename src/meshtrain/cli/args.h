// Command-line pieces shared by the subcommands: the usage error (exit code 2,
// cli/exit.h) and train's "--section.key value" config overrides.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/cli/exit.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

// "--section.key value" and "--section.key=value" pairs left over by CLI11.
ConfigOverrides parse_overrides(const std::vector<std::string>& args);

}  // namespace meshtrain
