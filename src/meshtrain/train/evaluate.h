// Scoring a model on token data: `meshtrain eval` and the training run's
// validation share this code. The windows are a ValidationSet's (the first
// batches x batch_size windows in file order, unshuffled, this dp rank's rows),
// the loss is the mean next-token cross-entropy over all their tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/model/model.h"

namespace meshtrain {

// How a global batch of `batch_size` windows is split: dp rank `dp_rank` of
// `dp_size` takes batch_size / dp_size rows, in micro-batches of at most
// `micro_batch_size` (training's loader and validation use the same split).
LoaderOptions rank_loader_options(int64_t batch_size, int64_t micro_batch_size, int64_t dp_rank,
                                  int64_t dp_size);

// The loss sum of this rank's windows of `val` (the whole model on this rank);
// adds their tokens to `tokens`. `scratch` holds one micro-batch.
double validation_loss_sum(Model& model, const ValidationSet& val, MicroBatch& scratch,
                           int64_t& tokens);

struct EvalOptions {
  std::vector<std::string> data;  // token files or SFT records (globs expanded)
  int64_t batches = 0;            // global batches; 0 = the run's train.eval_batches (else 8)
  int64_t batch_size = 0;         // 0 = the run's train.batch_size (else 8)
  int64_t micro_batch_size = 0;   // 0 = the run's train.micro_batch_size (else batch_size)
  int64_t seq_len = 0;            // 0 = the run's train.seq_len (else the model's max_seq_len)
  int threads = 0;
};

struct EvalResult {
  double loss = 0;        // mean over tokens
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // over all ranks
  int64_t batches = 0, batch_size = 0, seq_len = 0;
};

// Loss and perplexity of the checkpoint in `dir` (a training step directory of
// either format, or a Hugging Face one) on `options.data`: token shards, or an
// SFT run's JSONL records (an SFT run's checkpoint reads files that all begin
// with the token-file header as token shards); defaults come from a
// training checkpoint's config, so an eval of a step directory reproduces the
// val_loss that run logged at that step. With `dp` (a communicator over all
// ranks, or null), each rank scores its share of every batch and the sums are
// added over `dp`. Collective over `dp`.
EvalResult evaluate_checkpoint(const std::string& dir, const EvalOptions& options,
                               Communicator* dp);

// The fp32 logits [ids.size(), vocab] of the model in `dir` for one sequence,
// written to `out_path` as the safetensors tensor "logits" (f32).
void write_logits(const std::string& dir, const std::vector<int32_t>& ids,
                  const std::string& out_path, int threads);

}  // namespace meshtrain
