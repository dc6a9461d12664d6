// `meshtrain prepare`: text -> train/validation token shards in llm.c's format
// (token_file.h; uint32 ids past 65536). A document is one input file (or,
// with a separator, one part of a file); each document's tokens sit between
// the tokenizer's own ids (Tokenizer::document_frame: GPT-2's end-of-text
// before it, as GPT-2's data sets are; a post-processor's BOS before, as
// Llama's; or the end-of-sequence after, as Qwen's). Documents are encoded on many
// threads but written in input order, so the output depends only on the
// inputs and the options, never on the thread count.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "meshtrain/data/bpe_tokenizer.h"

namespace meshtrain {

struct PrepareOptions {
  // Text files and directories (a directory contributes its *.txt files,
  // sorted by name, not recursing). Files are taken in the order given.
  std::vector<std::string> inputs;
  // Receives train_000000.bin, train_000001.bin, ... and val_000000.bin, ...
  std::string output_dir;
  std::string tokenizer = "gpt2";  // make_tokenizer's: "gpt2", "bytes", or a tokenizer file or folder
  std::string gpt2_ranks = kDefaultGpt2Ranks;
  int64_t shard_tokens = 100'000'000;  // tokens per shard; the last one may be shorter
  // Share of the documents held out for validation (at least one when > 0),
  // chosen by a hash keyed by `seed`, so the choice is deterministic.
  double val_fraction = 0.0;
  uint64_t seed = 1337;
  std::string separator;  // non-empty: splits each file into documents at this exact text
  int threads = 0;        // 0 = all cores
  std::string progress = "auto";  // "auto" (bar on a terminal, else lines), "bar", "lines", "none"
};

struct PrepareSummary {
  int64_t documents = 0, train_documents = 0, val_documents = 0;
  int64_t text_bytes = 0;
  int64_t train_tokens = 0, val_tokens = 0;  // the framing ids included
  int64_t frame_tokens = 0;                  // per document
  int bytes_per_token = 2;                   // 4: token file version 2
  std::vector<std::string> train_files, val_files;
  double seconds = 0;
  int threads = 0;
};

// Does the work; progress goes to `progress_out` (may be null). Throws Error
// on bad options or unreadable input, naming the option or file.
PrepareSummary prepare_corpus(const PrepareOptions& options, std::FILE* progress_out);

// The CLI's entry: prepare_corpus with progress on stderr, then the summary
// on stdout. Returns the exit code (0); errors are thrown as Error.
int run_prepare(const PrepareOptions& options);

}  // namespace meshtrain
