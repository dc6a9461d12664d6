#include "meshtrain/data/sft.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>

#include "meshtrain/data/chat_template.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/text_file.h"

namespace meshtrain {
namespace {

using nlohmann::json;

const json& string_field(const json& object, const char* field, const std::string& where) {
  auto it = object.find(field);
  if (it == object.end()) fail("data: {}: field '{}' missing", where, field);
  if (!it->is_string()) fail("data: {}: field '{}' must be a string", where, field);
  return *it;
}

// Appends `text`'s ids, each with the loss flag.
void append(SftRecord& r, const Tokenizer& tokenizer, std::string_view text, bool in_loss) {
  tokenizer.encode_ordinary(text, r.tokens);
  r.in_loss.resize(r.tokens.size(), in_loss ? 1 : 0);
}

void append_id(SftRecord& r, int32_t id, bool in_loss) {
  r.tokens.push_back(id);
  r.in_loss.push_back(in_loss ? 1 : 0);
}

json parse_record(const std::string& json_line, const std::string& where) {
  try {
    return json::parse(json_line);
  } catch (const json::exception& e) {
    fail_as(ErrorKind::corrupt, "data: {}: not a JSON record ({})", where, e.what());
  }
}

// {"input_ids": [...], "assistant_masks": [...]}: ids below `vocab`, one 0/1 each.
SftRecord pretokenized_record(const json& record, int64_t vocab, const std::string& where) {
  const json& ids = record["input_ids"];
  MESHTRAIN_CHECK(record.contains("assistant_masks"), "data: {}: a record with 'input_ids' needs "
                  "'assistant_masks'", where);
  const json& mask = record["assistant_masks"];
  MESHTRAIN_CHECK(ids.is_array() && mask.is_array() && ids.size() == mask.size(),
                  "data: {}: 'input_ids' and 'assistant_masks' must be arrays of one length", where);
  SftRecord r;
  for (size_t i = 0; i < ids.size(); ++i) {
    MESHTRAIN_CHECK(ids[i].is_number_integer() && ids[i].get<int64_t>() >= 0 &&
                        ids[i].get<int64_t>() < vocab,
                    "data: {}: input_ids[{}] is not a token id below the vocabulary's {}", where,
                    i, vocab);
    MESHTRAIN_CHECK(mask[i] == 0 || mask[i] == 1, "data: {}: assistant_masks[{}] must be 0 or 1",
                    where, i);
    r.tokens.push_back(ids[i].get<int32_t>());
    r.in_loss.push_back(mask[i].get<uint8_t>());
  }
  return r;
}

SftRecord chat_record(const json& record, const Tokenizer& tokenizer, const ChatTemplate& tmpl,
                      const std::string& where) {
  const json messages = read_conversation(record, fmt::format("data: {}", where));
  ChatTokens t;
  try {
    t = chat_tokens(tokenizer, tmpl.render(messages, false));
  } catch (const Error& e) {  // the template's refusal, or tokens that do not follow the text
    throw Error(fmt::format("data: {}: {}", where, e.what()), e.kind());
  }
  MESHTRAIN_CHECK(std::ranges::find(t.mask, 1) != t.mask.end(), "data: {}: the conversation has "
                  "no assistant tokens (nothing to learn)", where);
  return {t.ids, t.mask};
}

SftRecord template_record(const json& record, const Tokenizer& tokenizer, const std::string& where);

}  // namespace

SftRecordReader sft_record_reader(std::string_view format, const Tokenizer& tokenizer) {
  std::shared_ptr<const ChatTemplate> tmpl;
  if (format == "chat-jsonl") tmpl = std::make_shared<ChatTemplate>(ChatTemplate::of(tokenizer));
  return [&tokenizer, tmpl](const std::string& line, const std::string& where) {
    const json record = parse_record(line, where);
    if (record.is_object() && record.contains("input_ids")) {
      return pretokenized_record(record, tokenizer.vocab_size(), where);
    }
    return tmpl ? chat_record(record, tokenizer, *tmpl, where)
                : template_record(record, tokenizer, where);
  };
}

void for_each_jsonl_line(const std::vector<std::string>& paths,
                         const std::function<void(const std::string& line,
                                                  const std::string& where)>& fn) {
  for (const std::string& path : paths) {
    const std::string text = read_file_text(path);
    size_t begin = 0;
    for (int64_t line = 1; begin < text.size(); ++line) {
      size_t end = text.find('\n', begin);
      if (end == std::string::npos) end = text.size();
      const std::string row = text.substr(begin, end - begin);
      begin = end + 1;
      if (row.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
      fn(row, fmt::format("{}:{}", path, line));
    }
  }
}

SftRecord tokenize_sft_record(const std::string& json_line, const Tokenizer& tokenizer,
                              const std::string& where) {
  return template_record(parse_record(json_line, where), tokenizer, where);
}

namespace {

// The role-prefix template of an sft-jsonl record.
SftRecord template_record(const json& record, const Tokenizer& tokenizer, const std::string& where) {
  if (!record.is_object()) fail("data: {}: a record must be a JSON object", where);
  // (role, content) turns.
  std::vector<std::pair<std::string, std::string>> turns;
  if (record.contains("messages")) {
    const json& messages = record["messages"];
    if (!messages.is_array() || messages.empty())
      fail("data: {}: field 'messages' must be a non-empty array", where);
    for (size_t i = 0; i < messages.size(); ++i) {
      const std::string at = fmt::format("{}: messages[{}]", where, i);
      if (!messages[i].is_object()) fail("data: {}: must be an object", at);
      std::string role = string_field(messages[i], "role", at).get<std::string>();
      if (role != "system" && role != "user" && role != "assistant")
        fail("data: {}: field 'role' is '{}'; expected system, user or assistant", at, role);
      turns.emplace_back(std::move(role),
                         string_field(messages[i], "content", at).get<std::string>());
    }
  } else {
    if (!record.contains("prompt") && !record.contains("response"))
      fail("data: {}: a record needs 'prompt' and 'response' or 'messages'", where);
    turns.emplace_back("user", string_field(record, "prompt", where).get<std::string>());
    turns.emplace_back("assistant", string_field(record, "response", where).get<std::string>());
  }
  const bool any_assistant = std::any_of(turns.begin(), turns.end(),
                                         [](const auto& t) { return t.first == "assistant"; });
  if (!any_assistant) fail("data: {}: field 'messages' has no assistant turn (nothing to learn)", where);

  const int32_t eot = tokenizer.eot_id();
  SftRecord r;
  append_id(r, eot, false);
  for (const auto& [role, content] : turns) {
    const bool assistant = role == "assistant";
    const std::string prefix = role == "system" ? "System: " : assistant ? "Assistant: " : "User: ";
    append(r, tokenizer, prefix, false);
    append(r, tokenizer, content, assistant);
    if (assistant) {
      append_id(r, eot, true);
    } else {
      append(r, tokenizer, "\n", false);
    }
  }
  return r;
}

}  // namespace

SftDataset::SftDataset(const std::vector<std::string>& paths, const Tokenizer& tokenizer,
                       const SftOptions& options)
    : SftDataset(paths, sft_record_reader("sft-jsonl", tokenizer), tokenizer.eot_id(), options) {}

SftDataset::SftDataset(const std::vector<std::string>& paths, const SftRecordReader& read,
                       int32_t pad, const SftOptions& options) {
  MESHTRAIN_CHECK(options.seq_len >= 1, "data: train.seq_len must be >= 1, got {}", options.seq_len);
  MESHTRAIN_CHECK(!paths.empty(), "data: no SFT files given");
  SftGroups records;
  for_each_jsonl_line(paths, [&](const std::string& row, const std::string& where) {
    SftRecord r = read(row, where);
    const int64_t pairs = static_cast<int64_t>(r.tokens.size()) - 1;
    if (pairs > options.seq_len) {
      if (!options.truncate) {
        fail("data: {}: record of {} tokens is longer than train.seq_len + 1 = {} (set "
             "data.sft_overflow = \"truncate\" to cut it)",
             where, r.tokens.size(), options.seq_len + 1);
      }
      r.tokens.resize(static_cast<size_t>(options.seq_len + 1));
      r.in_loss.resize(r.tokens.size());
      ++records.truncated;
    }
    records.groups.push_back({std::move(r)});
  });
  MESHTRAIN_CHECK(!records.groups.empty(), "data: the SFT files ({}) hold no record",
                  fmt::join(paths, ", "));
  build_rows(records, pad, options);
}

SftDataset::SftDataset(const SftGroups& groups, int32_t pad, const SftOptions& options) {
  MESHTRAIN_CHECK(options.seq_len >= 1, "data: train.seq_len must be >= 1, got {}", options.seq_len);
  MESHTRAIN_CHECK(!groups.groups.empty(), "data: no {} to train on", groups.noun);
  build_rows(groups, pad, options);
}

void SftDataset::build_rows(const SftGroups& groups, int32_t pad, const SftOptions& options) {
  seq_len_ = options.seq_len;
  noun_ = groups.noun;
  records_ = static_cast<int64_t>(groups.groups.size());
  truncated_ = groups.truncated;
  packed_ = options.pack || std::ranges::any_of(groups.groups, [](const auto& g) {
              return g.size() > 1;
            });
  const int64_t T = seq_len_;
  int64_t fill = T;  // tokens in the current row; T = no open row
  auto close_row = [&] {
    if (fill == T) return;
    const size_t row0 = inputs_.size() - static_cast<size_t>(T);
    for (int64_t t = fill; t < T; ++t) {
      inputs_[row0 + t] = pad;
      targets_[row0 + t] = -1;
      if (packed_) positions_[row0 + t] = static_cast<int32_t>(t - fill);
    }
    fill = T;
  };
  auto open_row = [&] {
    inputs_.resize(inputs_.size() + static_cast<size_t>(T));
    targets_.resize(inputs_.size());
    if (packed_) positions_.resize(inputs_.size());
    loss_counts_.push_back(0);
    fill = 0;
  };
  auto pairs_of = [](const SftRecord& r) { return static_cast<int64_t>(r.tokens.size()) - 1; };
  const KeyedPermutation order(static_cast<uint64_t>(records_), options.seed);
  for (int64_t k = 0; k < records_; ++k) {
    const std::vector<SftRecord>& group = groups.groups[static_cast<size_t>(
        options.shuffle ? static_cast<int64_t>(order(k)) : k)];
    int64_t pairs = 0;
    for (const SftRecord& r : group) pairs += std::max<int64_t>(0, pairs_of(r));
    if (pairs <= 0) continue;
    MESHTRAIN_CHECK(pairs <= T, "data: a group of {} {} tokens does not fit a row of {}", noun_,
                    pairs, T);
    if (!options.pack || fill + pairs > T) {
      close_row();
      open_row();
    }
    for (const SftRecord& r : group) {
      const size_t at = inputs_.size() - static_cast<size_t>(T) + static_cast<size_t>(fill);
      for (int64_t i = 0; i < pairs_of(r); ++i) {
        inputs_[at + i] = r.tokens[static_cast<size_t>(i)];
        const bool counted = r.in_loss[static_cast<size_t>(i + 1)] != 0;
        targets_[at + i] = counted ? r.tokens[static_cast<size_t>(i + 1)] : -1;
        if (packed_) positions_[at + i] = static_cast<int32_t>(i);
        if (counted) ++total_loss_;
        if (!groups.count_groups) loss_counts_.back() += counted ? 1 : 0;
      }
      fill += std::max<int64_t>(0, pairs_of(r));
    }
    if (groups.count_groups) ++loss_counts_.back();
  }
  close_row();
}

void SftDataset::read_sample(int64_t index, int32_t* inputs, int32_t* targets) const {
  MESHTRAIN_CHECK(index >= 0 && index < num_samples(), "data: SFT row {} out of range [0, {})",
                  index, num_samples());
  const size_t at = static_cast<size_t>(index * seq_len_);
  std::copy_n(inputs_.begin() + at, seq_len_, inputs);
  std::copy_n(targets_.begin() + at, seq_len_, targets);
}

void SftDataset::read_positions(int64_t index, int32_t* positions) const {
  MESHTRAIN_CHECK(packed_ && index >= 0 && index < num_samples(),
                  "data: SFT row {} has no positions (unpacked or out of range)", index);
  std::copy_n(positions_.begin() + static_cast<size_t>(index * seq_len_), seq_len_, positions);
}

int64_t SftDataset::loss_tokens(int64_t index) const {
  return loss_counts_[static_cast<size_t>(index)];
}

std::string SftDataset::describe() const {
  return fmt::format("{} {} ({} truncated) in {} {} rows of {}, {} loss tokens (packing "
                     "efficiency {:.3f})",
                     records_, noun_, truncated_, num_samples(), packed_ ? "packed" : "unpacked", seq_len_,
                     total_loss_, packing_efficiency());
}

double SftDataset::packing_efficiency() const {
  return static_cast<double>(total_loss_) / static_cast<double>(num_samples() * seq_len_);
}

}  // namespace meshtrain
