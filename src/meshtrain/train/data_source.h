// The samples a run reads (data.format): llm.c token shards or SFT records
// (data/sft.h). Training and evaluation (train/evaluate.h) open them alike.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshtrain/data/sampler.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

// `files` in config.data.format, windows of config.train.seq_len, ids below
// config.model.vocab_size. SFT: tokenized with config.data.tokenizer; training
// records (train = true) shuffled by train.seed before packing, validation in
// file order. Throws Error naming the file (and line) on bad input.
std::unique_ptr<SampleSource> open_sample_source(const TrainConfig& config,
                                                 const std::vector<std::string>& files, bool train);

}  // namespace meshtrain
