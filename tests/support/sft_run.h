// The SFT runs' config: a tiny llama (GQA 4/2, vocab 256 for the bytes
// tokenizer) on the committed JSONL fixture (tests/train/fixtures), packed
// rows of 128; tests set what differs through overrides.
#pragma once

#include <string>

#include "meshtrain/train/config.h"

namespace meshtrain::testing {

inline std::string sft_fixtures_dir() { return std::string(MESHTRAIN_SOURCE_DIR) + "/tests/train/fixtures"; }

inline TrainConfig sft_run_config(const std::string& out_dir, ConfigOverrides o) {
  o.insert(o.begin(), {"train.out_dir", out_dir});
  const std::string fixtures = sft_fixtures_dir();
  return parse_config(R"(
[model]
family = "llama"
dim = 16
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 32
vocab_size = 256
max_seq_len = 128
[train]
steps = 4
batch_size = 4
seq_len = 128
threads = 2
eval_batches = 1
peak_flops = 1e11
[optim]
lr = 3e-3
[data]
format = "sft-jsonl"
tokenizer = "bytes"
train = ")" + fixtures + R"(/sft_tiny.jsonl"
val = ")" + fixtures + R"(/sft_tiny_val.jsonl"
)",
                      "sft.toml", o);
}

}  // namespace meshtrain::testing
