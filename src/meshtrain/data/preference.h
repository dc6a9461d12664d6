// Preference pairs ([data] format = "preference-jsonl") for DPO / IPO
// (train/preference.h): one JSON record per line,
//   {"prompt": ..., "chosen": ..., "rejected": ...}
// where the prompt is a string (one user turn) or a list of {role, content}
// messages, and each response a string (one assistant turn) or a list of
// messages (TRL's "conversational" preference format). The pair becomes two
// conversations, prompt + chosen and prompt + rejected, rendered with the
// tokenizer's chat template when its folder has one, otherwise with the
// sft-jsonl template (data/sft.h); the loss covers the response's assistant
// turns only (their content and the token closing each), never an assistant
// turn of the prompt.
//
// Rows (SftDataset over SftGroups): a pair's two conversations are two
// segments of one row, chosen first, never split over rows; data.sft_pack
// packs several pairs per row. A row is thus segments chosen, rejected,
// chosen, rejected, ... then padding (targets -1); a row's loss_tokens are
// its pairs. A pair longer than train.seq_len is cut (data.sft_overflow =
// "truncate"): each response's end, the longer one first, until both fit in
// seq_len; a response left with no loss token is an Error naming the record.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/data/sft.h"
#include "meshtrain/data/tokenizer.h"

namespace meshtrain {

// One pair: the chosen and rejected conversations.
struct PreferencePair {
  SftRecord chosen, rejected;
};

// A record's pair, untruncated; Error (config) naming `where` (file:line)
// and the field.
using PreferenceReader =
    std::function<PreferencePair(const std::string& json_line, const std::string& where)>;
// `tokenizer` must outlive the reader.
PreferenceReader preference_reader(const Tokenizer& tokenizer);

// The rows of the records in `paths` (options as for SFT).
std::unique_ptr<SftDataset> open_preference_dataset(const std::vector<std::string>& paths,
                                                    const Tokenizer& tokenizer,
                                                    const SftOptions& options);

}  // namespace meshtrain
