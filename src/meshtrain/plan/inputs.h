// Parsing of the planner's human-sized inputs: "16M", "15T", "1.5e12", "8Ki".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace meshtrain::plan {

// A non-negative count with an optional suffix: K M G B T (powers of 1000, B =
// billion) or Ki Mi Gi Ti (powers of 1024). `option` names it in errors.
double parse_count(std::string_view text, std::string_view option);

struct GlobalBatch {
  int64_t sequences = 0;
  std::string note;  // set when the text had to be read in powers of 1024
};
// --global-batch-tokens: the decimal reading when it is a whole number of
// sequences, else the binary one ("16M" at seq 8192 = 16 x 2^20 = 2048
// sequences, as the Llama 3 paper means it), else Error.
GlobalBatch parse_global_batch_tokens(std::string_view text, int64_t seq);

}  // namespace meshtrain::plan
