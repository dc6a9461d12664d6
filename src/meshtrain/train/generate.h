// Text generation from a model: incremental decoding with the KV cache,
// greedy (temperature 0) or temperature + top-k sampling with a seeded,
// counter-based RNG (the draw for a position depends only on seed and position).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/model/model.h"

namespace meshtrain {

struct SampleOptions {
  float temperature = 1.0f;  // 0 = greedy (argmax)
  int64_t top_k = 0;         // 0 = the whole vocabulary
  uint64_t seed = 0;
  int64_t max_new_tokens = 64;
  // Generation ends after this id (a chat model's end-of-turn token), as
  // transformers' generate ends at its eos_token_id; none: max_new_tokens.
  std::optional<int32_t> stop_id;
};

// Picks a token from logits[vocab]. `draw` indexes the random stream.
int32_t pick_token(const float* logits, int64_t vocab, const SampleOptions& options,
                   uint64_t draw);

// Feeds the prompt (at least one id), then generates max_new_tokens; the two
// together must fit the model's context (prompt + new <= max_seq_len, else an
// Error naming the limit: positions past it were never trained). on_token sees
// each new id as it is produced. Returns the new ids.
std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& options,
                              const std::function<void(int32_t)>& on_token = {});

// "1,2,3" -> {1, 2, 3}; Error naming the bad entry.
std::vector<int32_t> parse_token_ids(const std::string& text);

}  // namespace meshtrain
