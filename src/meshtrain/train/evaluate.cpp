#include "meshtrain/train/evaluate.h"

#include <algorithm>
#include <cmath>

#include "meshtrain/backend/registry.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/data/sampler.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/data_source.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

LoaderOptions rank_loader_options(int64_t batch_size, int64_t micro_batch_size, int64_t dp_rank,
                                  int64_t dp_size) {
  LoaderOptions o;
  o.global_batch = batch_size;
  // Each dp rank runs batch_size / dp rows per batch, in micro-batches of at
  // most micro_batch_size.
  o.micro_batch = std::min(micro_batch_size, std::max<int64_t>(1, batch_size / dp_size));
  o.dp_rank = dp_rank;
  o.dp_size = dp_size;
  return o;
}

double validation_loss_sum(Model& model, const ValidationSet& val, MicroBatch& scratch,
                           int64_t& tokens) {
  double loss = 0;
  for (int64_t k = 0; k < val.num_micro_batches(); ++k) {
    val.read(k, scratch);
    tokens += count_loss_tokens(scratch);
    loss += model.forward_loss(scratch.inputs.data(), scratch.targets.data(), scratch.rows,
                               scratch.seq_len, positions_of(scratch));
  }
  return loss;
}

EvalResult evaluate_checkpoint(const std::string& dir, const EvalOptions& options,
                               Communicator* dp) {
  MESHTRAIN_CHECK(!options.data.empty(), "eval: no token files given (--data)");
  // A training run's own settings, so its logged val_loss is reproduced.
  Precision precision = Precision::fp32;
  int64_t batches = 8, batch_size = 8, micro = 0, seq = 0;
  TrainConfig run;  // its data settings (format, tokenizer); token shards for other directories
  if (is_training_checkpoint(dir)) {
    read_train_state(dir, &run);
    precision = run.train.precision;
    batches = run.train.eval_batches;
    batch_size = run.train.batch_size;
    micro = run.train.micro_batch_size;
    seq = run.train.seq_len;
    // An SFT run scores token shards too (its val_*.bin in the same token ids).
    if (run.data.sft() && std::all_of(options.data.begin(), options.data.end(), is_token_file)) {
      run.data.format = "tokens";
    }
  }
  if (options.batches > 0) batches = options.batches;
  if (options.batch_size > 0) batch_size = options.batch_size;
  if (options.micro_batch_size > 0) micro = options.micro_batch_size;
  if (options.seq_len > 0) seq = options.seq_len;
  if (micro <= 0) micro = batch_size;

  MemoryTracker tracker;
  const std::unique_ptr<Backend> backend = make_backend(kHostBackend, options.threads, tracker);
  std::unique_ptr<Model> model = load_model_dir(dir, precision, *backend);
  const ModelConfig& c = model->config();
  if (seq <= 0) seq = c.max_seq_len;
  MESHTRAIN_CHECK(seq <= c.max_seq_len, "eval: seq_len {} is beyond the model's max_seq_len {}",
                  seq, c.max_seq_len);

  const int64_t rank = dp ? dp->rank() : 0, ranks = dp ? dp->size() : 1;
  run.model = c;
  run.train.seq_len = seq;
  const std::unique_ptr<SampleSource> source = open_sample_source(run, options.data, false);
  const SampleSource& data = *source;
  const ValidationSet val(data, rank_loader_options(batch_size, micro, rank, ranks), batches);
  MicroBatch scratch;
  int64_t tokens = 0;
  double loss_sum = validation_loss_sum(*model, val, scratch, tokens);
  if (dp != nullptr) {
    loss_sum = sum_over_ranks(*dp, loss_sum);
    tokens = static_cast<int64_t>(sum_over_ranks(*dp, static_cast<double>(tokens)));
  }
  EvalResult r;
  r.loss = loss_sum / static_cast<double>(tokens);
  r.perplexity = std::exp(r.loss);
  r.tokens = tokens;
  r.batches = batches;
  r.batch_size = batch_size;
  r.seq_len = seq;
  return r;
}

void write_logits(const std::string& dir, const std::vector<int32_t>& ids,
                  const std::string& out_path, int threads) {
  MESHTRAIN_CHECK(!ids.empty(), "eval: --logits-ids needs at least one id");
  MESHTRAIN_CHECK(!out_path.empty(), "eval: --logits-ids needs --logits-out");
  MemoryTracker tracker;
  const std::unique_ptr<Backend> backend = make_backend(kHostBackend, threads, tracker);
  std::unique_ptr<Model> model = load_model_dir(dir, Precision::fp32, *backend);
  const ModelConfig& c = model->config();
  const auto n = static_cast<int64_t>(ids.size());
  MESHTRAIN_CHECK(n <= c.max_seq_len, "eval: {} logits ids are more than max_seq_len {}", n,
                  c.max_seq_len);
  for (int32_t id : ids) {
    MESHTRAIN_CHECK(id >= 0 && id < c.vocab_size, "eval: logits id {} is outside the vocabulary "
                    "[0, {})", id, c.vocab_size);
  }
  Tensor logits({n, c.vocab_size}, DType::f32, MemCategory::workspace, tracker);
  model->forward_logits(ids.data(), 1, n, logits.data<float>());
  SafetensorsWriter writer;
  writer.add("logits", logits);
  writer.write(out_path);
}

}  // namespace meshtrain
