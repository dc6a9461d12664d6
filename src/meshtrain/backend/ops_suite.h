// The backend test suite behind `meshtrain ops test`, in the pattern of
// llama.cpp's test-backend-ops: every operation of the ops layer (backend.h),
// forward and backward, over a table of shapes (odd sizes, GQA ratios, packed
// records, every dtype the engine uses) on random inputs. Each result is
// compared by normalised mean squared error, with a threshold per op and
// dtype, against the float64 reference (ops_reference.h) or, for a backend
// given a `reference` backend, against that backend's result. Every buffer an
// op gets has guard bytes before and after it that must come back untouched,
// and an output must be finite where the reference is.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "meshtrain/backend/backend.h"

namespace meshtrain {

struct OpsTestOptions {
  std::string op_regex;  // ops whose name matches (std::regex_search); "" = all
  uint32_t seed = 1;
  bool verbose = false;  // every case's line, not only the failures and a line per op
};

struct OpsTestResult {
  int passed = 0;
  std::vector<std::string> failures;  // "op params: why"
};

// Names of every op the suite covers (the ops of backend.h).
std::vector<std::string> ops_test_names();

// Runs the suite on `backend`, comparing with `reference` (a CPU backend) when
// given, else with float64; one line per case to `out` (see options).
OpsTestResult run_ops_test(Backend& backend, Backend* reference, const OpsTestOptions& options,
                           std::FILE* out);

}  // namespace meshtrain
