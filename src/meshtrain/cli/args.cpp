#include "meshtrain/cli/args.h"

#include <fmt/format.h>

namespace meshtrain {

ConfigOverrides parse_overrides(const std::vector<std::string>& args) {
  ConfigOverrides overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0 || arg.find('.') == std::string::npos) {
      throw UsageError(fmt::format("train: unexpected argument '{}' (overrides are --section.key value)", arg));
    }
    std::string key = arg.substr(2), value;
    if (auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key.resize(eq);
    } else {
      if (i + 1 >= args.size()) throw UsageError(fmt::format("train: {} needs a value", arg));
      value = args[++i];
    }
    overrides.emplace_back(key, value);
  }
  return overrides;
}

}  // namespace meshtrain
