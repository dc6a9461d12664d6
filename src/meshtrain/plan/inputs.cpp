#include "meshtrain/plan/inputs.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "meshtrain/util/error.h"

namespace meshtrain::plan {
namespace {

struct Split {
  double value = 0;
  std::string unit;
};

Split split_number(std::string_view text, std::string_view option) {
  const std::string s(text);
  char* end = nullptr;
  const double value = s.empty() ? NAN : std::strtod(s.c_str(), &end);
  MESHTRAIN_CHECK(!s.empty() && end != s.c_str() && std::isfinite(value) && value >= 0,
                  "plan: {} '{}' is not a non-negative number (e.g. 16M, 15T, 1.5e12)", option,
                  text);
  return {value, std::string(end)};
}

double multiplier(const std::string& unit, bool binary_for_decimal, std::string_view option,
                  std::string_view text) {
  const double k = binary_for_decimal ? 1024.0 : 1000.0;
  if (unit.empty()) return 1;
  if (unit == "K" || unit == "k") return k;
  if (unit == "M") return k * k;
  if (unit == "G" || unit == "B") return k * k * k;
  if (unit == "T") return k * k * k * k;
  if (unit == "Ki") return 1024.0;
  if (unit == "Mi") return 1024.0 * 1024;
  if (unit == "Gi") return 1024.0 * 1024 * 1024;
  if (unit == "Ti") return 1024.0 * 1024 * 1024 * 1024;
  fail("plan: {} '{}' has an unknown suffix '{}' (K M G/B T, or Ki Mi Gi Ti)", option, text, unit);
}

}  // namespace

double parse_count(std::string_view text, std::string_view option) {
  const Split s = split_number(text, option);
  return s.value * multiplier(s.unit, false, option, text);
}

GlobalBatch parse_global_batch_tokens(std::string_view text, int64_t seq) {
  const std::string_view option = "--global-batch-tokens";
  MESHTRAIN_CHECK(seq > 0, "plan: --seq must be > 0, got {}", seq);
  const Split s = split_number(text, option);
  const double decimal = s.value * multiplier(s.unit, false, option, text);
  const double binary = s.value * multiplier(s.unit, true, option, text);
  const double q = static_cast<double>(seq);
  auto whole = [&](double tokens) {
    return tokens >= q && std::fmod(tokens, q) == 0 && tokens == std::floor(tokens);
  };
  if (whole(decimal)) return {static_cast<int64_t>(decimal / q), ""};
  if (binary != decimal && whole(binary)) {
    return {static_cast<int64_t>(binary / q),
            fmt::format("'{}' read as {:.0f} = {:.0f} x {}: the decimal {:.0f} is not a whole "
                        "number of sequences",
                        text, binary, binary / q, seq, decimal)};
  }
  fail("plan: --global-batch-tokens {} ({:.0f} tokens) is not a whole number of {}-token "
       "sequences",
       text, decimal, seq);
}

}  // namespace meshtrain::plan
