// Model shapes the planner knows by name: the published GPT-2, Llama-2 and
// Llama-3 configurations, the engine's own presets, and GPT-3-style dense
// shapes given by layers / hidden / heads / vocab.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/model/config.h"

namespace meshtrain::plan {

struct PlanModel {
  std::string name;
  ModelConfig config;
  double published_params = 0;  // the size its authors state (0: none)
  std::string source;           // where the shape and the size come from
};

// "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "llama2-7b", "llama2-13b",
// "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b", or any of
// model_preset_names(). Throws Error listing the known names.
PlanModel plan_model(std::string_view name);
std::vector<std::string> plan_model_names();  // the published ones (not the engine's)

// A GPT-3-style dense decoder (Brown et al. 2020, table 2.1): LayerNorm,
// learned positions, GELU MLP of 4*hidden, tied output, multi-head attention.
ModelConfig gpt_dense(int64_t layers, int64_t hidden, int64_t heads, int64_t vocab,
                      int64_t max_seq);

}  // namespace meshtrain::plan
