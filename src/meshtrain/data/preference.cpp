#include "meshtrain/data/preference.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

using nlohmann::json;

// A prompt or response field as a list of messages: a string is one turn of
// `role`.
json turns_of(const json& record, const char* field, const char* role, const std::string& where) {
  const auto it = record.find(field);
  MESHTRAIN_CHECK(it != record.end(), "data: {}: field '{}' missing (a preference record needs "
                  "'prompt', 'chosen' and 'rejected')", where, field);
  if (it->is_string()) return json::array({{{"role", role}, {"content", *it}}});
  MESHTRAIN_CHECK(it->is_array() && !it->empty(),
                  "data: {}: field '{}' must be a string or a non-empty list of messages", where,
                  field);
  return *it;
}

// Keeps the loss on the last `turns` runs of loss tokens (the response's
// assistant turns), none on the prompt's.
void keep_last_runs(SftRecord& r, int64_t turns) {
  int64_t seen = 0;
  for (size_t i = r.in_loss.size(); i-- > 0;) {
    if (r.in_loss[i] == 0) continue;
    const bool run_start = i == 0 || r.in_loss[i - 1] == 0;
    if (seen >= turns) r.in_loss[i] = 0;
    if (run_start) ++seen;
  }
}

int64_t assistant_turns(const json& messages) {
  return std::ranges::count_if(messages, [](const json& m) {
    return m.is_object() && m.value("role", "") == "assistant";
  });
}

int64_t loss_tokens(const SftRecord& r) {
  return std::ranges::count_if(r.in_loss.begin() + 1, r.in_loss.end(),
                               [](uint8_t f) { return f != 0; });
}

// Cuts the pair's responses at their ends until their (input, target) pairs
// fit in seq_len together: the longer first, neither below half while the
// other needs it.
void truncate_pair(PreferencePair& p, int64_t seq_len, const std::string& where) {
  auto pairs = [](const SftRecord& r) { return static_cast<int64_t>(r.tokens.size()) - 1; };
  int64_t c = pairs(p.chosen), r = pairs(p.rejected);
  const int64_t half = seq_len / 2;
  if (c <= half) {
    r = seq_len - c;
  } else if (r <= half) {
    c = seq_len - r;
  } else {
    c = half, r = seq_len - half;
  }
  for (auto [record, keep, name] : {std::tuple{&p.chosen, c, "chosen"},
                                    std::tuple{&p.rejected, r, "rejected"}}) {
    record->tokens.resize(static_cast<size_t>(keep + 1));
    record->in_loss.resize(record->tokens.size());
    MESHTRAIN_CHECK(loss_tokens(*record) > 0,
                    "data: {}: the {} response is empty after truncation to {} tokens "
                    "(train.seq_len = {} holds the prompt and both responses)",
                    where, name, keep + 1, seq_len);
  }
}

}  // namespace

PreferenceReader preference_reader(const Tokenizer& tokenizer) {
  // The model's chat template where its folder has one, else sft-jsonl's.
  const SftRecordReader read = sft_record_reader(
      tokenizer.config().chat_template.empty() ? "sft-jsonl" : "chat-jsonl", tokenizer);
  return [read](const std::string& line, const std::string& where) {
    json record;
    try {
      record = json::parse(line);
    } catch (const json::exception& e) {
      fail_as(ErrorKind::corrupt, "data: {}: not a JSON record ({})", where, e.what());
    }
    MESHTRAIN_CHECK(record.is_object(), "data: {}: a preference record must be a JSON object",
                    where);
    const json prompt = turns_of(record, "prompt", "user", where);
    PreferencePair pair;
    for (auto [out, field] : {std::pair{&pair.chosen, "chosen"},
                              std::pair{&pair.rejected, "rejected"}}) {
      const json response = turns_of(record, field, "assistant", where);
      const int64_t turns = assistant_turns(response);
      MESHTRAIN_CHECK(turns > 0, "data: {}: field '{}' has no assistant turn", where, field);
      json conversation = prompt;
      conversation.insert(conversation.end(), response.begin(), response.end());
      *out = read(json{{"messages", conversation}}.dump(), fmt::format("{} ({})", where, field));
      keep_last_runs(*out, turns);
      MESHTRAIN_CHECK(loss_tokens(*out) > 0, "data: {}: the {} response is empty", where, field);
    }
    return pair;
  };
}

std::unique_ptr<SftDataset> open_preference_dataset(const std::vector<std::string>& paths,
                                                    const Tokenizer& tokenizer,
                                                    const SftOptions& options) {
  MESHTRAIN_CHECK(!paths.empty(), "data: no preference files given");
  const PreferenceReader read = preference_reader(tokenizer);
  SftGroups groups;
  groups.count_groups = true;
  groups.noun = "preference pairs";
  for_each_jsonl_line(paths, [&](const std::string& line, const std::string& where) {
    PreferencePair p = read(line, where);
    const int64_t pairs = static_cast<int64_t>(p.chosen.tokens.size() + p.rejected.tokens.size()) - 2;
    if (pairs > options.seq_len) {
      MESHTRAIN_CHECK(options.truncate,
                      "data: {}: the pair's two conversations are {} tokens, longer than "
                      "train.seq_len = {} (set data.sft_overflow = \"truncate\" to cut them)",
                      where, pairs + 2, options.seq_len);
      truncate_pair(p, options.seq_len, where);
      ++groups.truncated;
    }
    groups.groups.push_back({std::move(p.chosen), std::move(p.rejected)});
  });
  MESHTRAIN_CHECK(!groups.groups.empty(), "data: the preference files ({}) hold no record",
                  fmt::join(paths, ", "));
  return std::make_unique<SftDataset>(groups, tokenizer.eot_id(), options);
}

}  // namespace meshtrain
