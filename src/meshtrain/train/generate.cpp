#include "meshtrain/train/generate.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>

#include "meshtrain/util/error.h"
#include "meshtrain/util/rng.h"

namespace meshtrain {

int32_t pick_token(const float* logits, int64_t vocab, const SampleOptions& options,
                   uint64_t draw) {
  MESHTRAIN_CHECK(options.temperature >= 0, "sample: temperature must be >= 0, got {}",
                  options.temperature);
  if (options.temperature == 0.0f) {
    // First maximum: ties go to the lowest id, like torch.argmax.
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  }
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  int64_t k = options.top_k > 0 ? std::min(options.top_k, vocab) : vocab;
  // Highest logits first; ties by id, so the order is fully determined.
  auto higher = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), higher);
  ids.resize(static_cast<size_t>(k));
  std::vector<double> weights(ids.size());
  double max_logit = logits[ids[0]], total = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    weights[i] = std::exp((double(logits[ids[i]]) - max_logit) / options.temperature);
    total += weights[i];
  }
  double u = static_cast<double>(mix64(stream_key(options.seed, "sample") ^ mix64(draw)) >> 11) *
             (1.0 / 9007199254740992.0) * total;
  for (size_t i = 0; i < ids.size(); ++i) {
    u -= weights[i];
    if (u < 0) return ids[i];
  }
  return ids.back();
}

std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& options,
                              const std::function<void(int32_t)>& on_token) {
  const ModelConfig& config = model.config();
  MESHTRAIN_CHECK(!prompt.empty(), "sample: the prompt needs at least one token id");
  MESHTRAIN_CHECK(options.max_new_tokens >= 0, "sample: max_new_tokens must be >= 0, got {}",
                  options.max_new_tokens);
  for (int32_t id : prompt) {
    MESHTRAIN_CHECK(id >= 0 && id < config.vocab_size,
                    "sample: prompt id {} is outside the vocabulary [0, {})", id,
                    config.vocab_size);
  }
  auto prompt_len = static_cast<int64_t>(prompt.size());
  MESHTRAIN_CHECK(prompt_len + options.max_new_tokens <= config.max_seq_len,
                  "sample: the prompt ({} ids) + max_new_tokens ({}) exceed the model's context, "
                  "max_seq_len {}", prompt_len, options.max_new_tokens, config.max_seq_len);
  KVCache cache = model.make_kv_cache(1, config.max_seq_len);
  Tensor logits({config.vocab_size}, DType::f32, MemCategory::workspace, model.backend().tracker());
  model.decode(prompt.data(), 1, prompt_len, cache, logits.data<float>());
  std::vector<int32_t> text = prompt, out;
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    int32_t id = pick_token(logits.data<float>(), config.vocab_size, options,
                            static_cast<uint64_t>(text.size()));
    out.push_back(id);
    text.push_back(id);
    if (on_token) on_token(id);
    if (i + 1 == options.max_new_tokens || id == options.stop_id) break;
    model.decode(&id, 1, 1, cache, logits.data<float>());
  }
  return out;
}

std::vector<int32_t> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    int32_t id = 0;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
    MESHTRAIN_CHECK(!item.empty() && ec == std::errc() && ptr == item.data() + item.size() && id >= 0,
                    "token ids: '{}' is not a non-negative integer (in \"{}\")", item, text);
    ids.push_back(id);
    start = end + 1;
  }
  return ids;
}

}  // namespace meshtrain
