// Supervised fine-tuning data ([data] format = "sft-jsonl"): JSONL records,
// tokenized with the run's tokenizer into one token sequence per record with
// a loss mask (response / assistant tokens only), then laid out in rows of
// seq_len (input, target) pairs: packed (several records per row, each
// token's position in its record carried for the attention mask) or one
// record per row. docs/data.md#supervised-fine-tuning states the template.
//
// A record is {"prompt": str, "response": str} or {"messages": [{"role":
// "system" | "user" | "assistant", "content": str}, ...]} (at least one
// assistant turn). Template, with E = the tokenizer's eot id (bos and eos):
//   E  then per message:  "<Role>: " content "\n"   (Role = System | User | Assistant)
//   except that an assistant turn ends with E instead of "\n".
// prompt/response is the chat [user: prompt, assistant: response]. Loss is on
// an assistant turn's content and its closing E; everything else (E at the
// start, role prefixes, system and user turns) is context only.
//
// [data] format = "chat-jsonl" reads the same {"messages": [...]} records (or a
// bare list of messages) with the model's own chat template instead
// (data/chat_template.h): the conversation rendered once, its text tokenized
// once, the loss on the assistant content and the token closing each turn, or
// on the template's {% generation %} blocks where it has them.
//
// Both formats also take records already tokenized, in the names transformers'
// apply_chat_template(return_dict=True, return_assistant_tokens_mask=True)
// gives them: {"input_ids": [...], "assistant_masks": [0/1 ...]}.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/data/sampler.h"
#include "meshtrain/data/tokenizer.h"

namespace meshtrain {

// One tokenized record: tokens and, per token, whether predicting it counts
// in the loss (its pair's target is the token; tokens[0] is never predicted).
struct SftRecord {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> in_loss;
};

// The template above; throws Error (config) naming `where` (file:line) and
// the field when the record is malformed.
SftRecord tokenize_sft_record(const std::string& json_line, const Tokenizer& tokenizer,
                              const std::string& where);

// Calls fn(line, where) for each non-blank line of the JSONL files, where =
// "file:line" (1-based) for its errors.
void for_each_jsonl_line(const std::vector<std::string>& paths,
                         const std::function<void(const std::string& line,
                                                  const std::string& where)>& fn);

// One JSONL line to its record; `where` (file:line) names it in errors.
using SftRecordReader =
    std::function<SftRecord(const std::string& json_line, const std::string& where)>;
// The reader of data.format "sft-jsonl" or "chat-jsonl" (the latter: Error
// when the tokenizer has no chat template). `tokenizer` must outlive it.
SftRecordReader sft_record_reader(std::string_view format, const Tokenizer& tokenizer);

struct SftOptions {
  int64_t seq_len = 0;
  bool pack = true;        // several records per row (first records in shuffled order, greedy)
  bool truncate = true;    // a record longer than seq_len pairs: cut (true) or refuse (false)
  bool shuffle = true;     // shuffle records (keyed by seed) before packing; false: file order
  uint64_t seed = 0;
};

// Records that share a row: each a segment of its own (positions restart at
// its first token), in order, never split over rows (a preference pair's
// chosen and rejected conversations, data/preference.h). `truncated`: how
// many were cut to fit; `count_groups`: a row's loss_tokens counts its groups
// (pairs) instead of its loss tokens; `noun` names the groups in describe().
struct SftGroups {
  std::vector<std::vector<SftRecord>> groups;
  int64_t truncated = 0;
  bool count_groups = false;
  std::string noun = "SFT records";
};

// Rows of seq_len pairs built once at start. Packing: records in a keyed
// permutation of (seed) (file order without shuffle), each appended to the
// current row if its pairs fit, else the row is closed (padded) and a new one
// begins. Padding: input E, target -1, positions restarting at 0 (a segment of
// its own). Unpacked rows carry no positions (the token path's kernels).
class SftDataset final : public SampleSource {
 public:
  // Records read by `read`; `pad` fills rows (the tokenizer's eot id).
  SftDataset(const std::vector<std::string>& paths, const SftRecordReader& read, int32_t pad,
             const SftOptions& options);
  // sft-jsonl records.
  SftDataset(const std::vector<std::string>& paths, const Tokenizer& tokenizer,
             const SftOptions& options);
  // Groups of records, each group packed as one unit (options.pack: several
  // groups per row); rows hold positions when packed or when a group has
  // several records.
  SftDataset(const SftGroups& groups, int32_t pad, const SftOptions& options);

  int64_t num_samples() const override { return static_cast<int64_t>(loss_counts_.size()); }
  int64_t seq_len() const override { return seq_len_; }
  void read_sample(int64_t index, int32_t* inputs, int32_t* targets) const override;
  bool has_positions() const override { return packed_; }
  void read_positions(int64_t index, int32_t* positions) const override;
  int64_t loss_tokens(int64_t index) const override;
  std::string describe() const override;

  int64_t num_records() const { return records_; }  // groups (SftGroups), records otherwise
  int64_t truncated_records() const { return truncated_; }
  int64_t total_loss_tokens() const { return total_loss_; }
  // Loss tokens / row tokens: how much of each row trains.
  double packing_efficiency() const;

 private:
  // Lays `groups` out in rows (the constructors' common part).
  void build_rows(const SftGroups& groups, int32_t pad, const SftOptions& options);

  int64_t seq_len_ = 0;
  bool packed_ = true;  // rows hold positions
  std::string noun_;
  int64_t records_ = 0, truncated_ = 0, total_loss_ = 0;
  std::vector<int32_t> inputs_, targets_, positions_;  // num_samples x seq_len
  std::vector<int64_t> loss_counts_;                    // per row (tokens, or groups)
};

}  // namespace meshtrain
