#include "meshtrain/train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

std::string format_flops(double flops) {
  if (flops >= 1e12) return fmt::format("{:.2f} TFLOP/s", flops / 1e12);
  return fmt::format("{:.1f} GFLOP/s", flops / 1e9);
}

// JSON has no NaN; a diverged value is written as null.
nlohmann::json number(double value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

bool same_model(const ModelConfig& a, const ModelConfig& b) {
  return a.family == b.family && a.dim == b.dim && a.n_layers == b.n_layers &&
         a.n_heads == b.n_heads && a.n_kv_heads == b.n_kv_heads && a.hidden_dim == b.hidden_dim &&
         a.vocab_size == b.vocab_size && a.max_seq_len == b.max_seq_len &&
         a.norm_eps == b.norm_eps && a.rope_theta == b.rope_theta &&
         a.tie_embeddings == b.tie_embeddings;
}

}  // namespace

Trainer::Trainer(const TrainConfig& config, const TrainerOptions& options)
    : config_(config), options_(options), schedule_(config.lr_schedule()) {
  const TrainSettings& t = config_.train;
  TrainState resumed;
  if (!options_.resume_dir.empty()) {
    TrainConfig saved;
    resumed = read_train_state(options_.resume_dir, &saved);
    MESHTRAIN_CHECK(same_model(saved.model, config_.model),
                    "resume: the model in '{}' differs from the configured [model]",
                    options_.resume_dir);
  }

  // Data first: a bad file should fail before anything slow happens.
  train_data_ = std::make_unique<TokenDataset>(expand_train_files(config_.data),
                                               config_.model.vocab_size, t.seq_len);
  if (!config_.data.val.empty()) {
    val_data_ = std::make_unique<TokenDataset>(std::vector<std::string>{config_.data.val},
                                               config_.model.vocab_size, t.seq_len);
  }
  sampler_ = std::make_unique<ShuffledSampler>(train_data_->num_samples(), t.seed);

  ctx_ = std::make_unique<cpu::CpuContext>(t.threads, tracker_);
  model_ = std::make_unique<Model>(config_.model, t.precision, *ctx_);
  optimizer_ = std::make_unique<AdamW>(*model_, config_.optim.adamw);
  if (options_.resume_dir.empty()) {
    model_->init_weights(t.seed);
  } else {
    load_checkpoint_tensors(options_.resume_dir, *model_, *optimizer_);
    optimizer_->set_step_count(resumed.optimizer_step);
    sampler_->set_position(resumed.sampler);
    step_ = resumed.step;
  }
  inputs_.resize(static_cast<size_t>(t.micro_batch_size * t.seq_len));
  targets_.resize(inputs_.size());

  fs::create_directories(t.out_dir);
  std::string metrics_path = (fs::path(t.out_dir) / "metrics.jsonl").string();
  // A resumed run appends to the trace of the run it continues.
  metrics_.open(metrics_path, options_.resume_dir.empty() ? std::ios::trunc : std::ios::app);
  MESHTRAIN_CHECK(metrics_.good(), "cannot write metrics file '{}'", metrics_path);

  if (t.peak_flops > 0) {
    peak_flops_ = t.peak_flops;
    peak_source_ = "from train.peak_flops";
  } else {
    DType dtype = compute_dtype(t.precision);
    peak_flops_ = cpu::measure_matmul_peak_flops(*ctx_, dtype);
    peak_source_ = fmt::format("measured: {} oneDNN matmul, {} threads", dtype_name(dtype),
                               ctx_->threads());
  }

  if (options_.console) {
    const ModelConfig& m = config_.model;
    fmt::print("model: {} {}dim {}, {} layers, {} heads ({} kv), hidden {}, vocab {}: {} params\n",
               family_name(m.family),
               config_.model_preset.empty() ? "" : fmt::format("({}) ", config_.model_preset),
               m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.hidden_dim, m.vocab_size,
               model_->num_params());
    fmt::print("train: {} steps, {} x {} tokens per step ({} micro-batches of {}), {}, {} threads\n",
               t.steps, t.batch_size, t.seq_len, t.grad_accum_steps(), t.micro_batch_size,
               precision_name(t.precision), ctx_->threads());
    fmt::print("data: {} tokens, {} samples of {} (+1) tokens{}\n", train_data_->num_tokens(),
               train_data_->num_samples(), t.seq_len,
               val_data_ ? fmt::format("; val {} tokens", val_data_->num_tokens()) : "");
    fmt::print("MFU peak: {} ({})\n", format_flops(peak_flops_), peak_source_);
    if (!options_.resume_dir.empty()) {
      fmt::print("resumed from {} at step {} (epoch {}, sample {})\n", options_.resume_dir, step_,
                 resumed.sampler.epoch, resumed.sampler.index);
    }
    fmt::print("memory: {}\n", tracker_.report());
    std::fflush(stdout);
  }
}

Trainer::~Trainer() = default;

StepRecord Trainer::train_step() {
  const TrainSettings& t = config_.train;
  auto start = std::chrono::steady_clock::now();
  const int64_t micro = t.micro_batch_size, seq = t.seq_len;
  // Each token's loss weighs 1/tokens-per-step: the gradient of the step's mean.
  const float grad_scale = 1.0f / static_cast<float>(t.tokens_per_step());

  model_->zero_grads();
  double loss_sum = 0;
  for (int64_t a = 0; a < t.grad_accum_steps(); ++a) {
    for (int64_t b = 0; b < micro; ++b) {
      train_data_->read_sample(sampler_->next(), inputs_.data() + b * seq,
                               targets_.data() + b * seq);
    }
    loss_sum += model_->forward_backward(inputs_.data(), targets_.data(), micro, seq, grad_scale);
  }
  StepRecord r;
  r.step = step_ + 1;
  r.loss = loss_sum / static_cast<double>(t.tokens_per_step());
  MESHTRAIN_CHECK(std::isfinite(r.loss), "step {}: loss is {}: training diverged", r.step, r.loss);
  r.grad_norm = global_grad_norm(*model_);
  MESHTRAIN_CHECK(std::isfinite(r.grad_norm), "step {}: gradient norm is {}: training diverged",
                  r.step, r.grad_norm);
  r.lr = schedule_.at(step_);
  optimizer_->step(r.lr, clip_factor(r.grad_norm, t.grad_clip));
  ++step_;

  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto tokens = static_cast<double>(t.tokens_per_step());
  r.step_ms = seconds * 1e3;
  r.tokens_per_s = tokens / seconds;
  r.mfu = config_.model.train_flops_per_token(seq) * tokens / seconds / peak_flops_;
  return r;
}

double Trainer::evaluate() {
  MESHTRAIN_CHECK(val_data_ != nullptr, "evaluate: no validation data (data.val)");
  const TrainSettings& t = config_.train;
  const int64_t micro = t.micro_batch_size, seq = t.seq_len;
  // Always the same leading samples, so successive values are comparable.
  double loss_sum = 0;
  int64_t sample = 0;
  for (int64_t e = 0; e < t.eval_batches; ++e) {
    for (int64_t b = 0; b < micro; ++b) {
      val_data_->read_sample(sample, inputs_.data() + b * seq, targets_.data() + b * seq);
      sample = (sample + 1) % val_data_->num_samples();
    }
    loss_sum += model_->forward_loss(inputs_.data(), targets_.data(), micro, seq);
  }
  return loss_sum / static_cast<double>(t.eval_batches * micro * seq);
}

std::string Trainer::save_checkpoint() {
  std::string dir = (fs::path(config_.train.out_dir) / step_dir_name(step_)).string();
  TrainState state;
  state.step = step_;
  state.optimizer_step = optimizer_->step_count();
  state.sampler = sampler_->position();
  state.seed = config_.train.seed;
  meshtrain::save_checkpoint(dir, *model_, *optimizer_, state, config_);
  return dir;
}

void Trainer::log_step(const StepRecord& r) {
  metrics_ << nlohmann::json{{"step", r.step},
                             {"loss", number(r.loss)},
                             {"lr", r.lr},
                             {"grad_norm", number(r.grad_norm)},
                             {"tokens_per_s", r.tokens_per_s},
                             {"mfu", r.mfu},
                             {"step_ms", r.step_ms}}
                  .dump()
           << '\n';
  metrics_.flush();
  const TrainSettings& t = config_.train;
  if (options_.console && (r.step % t.log_interval == 0 || r.step == 1 || r.step == t.steps)) {
    fmt::print("step {:>5}/{} | loss {:.4f} | lr {:.3e} | grad_norm {:.3f} | {:.0f} tok/s | "
               "MFU {:.1f}% | {:.1f} ms\n",
               r.step, t.steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.mfu * 100, r.step_ms);
    std::fflush(stdout);
  }
}

void Trainer::log_eval(double val_loss) {
  metrics_ << nlohmann::json{{"step", step_}, {"val_loss", number(val_loss)}}.dump() << '\n';
  metrics_.flush();
  if (options_.console) {
    fmt::print("step {:>5}/{} | val_loss {:.4f}\n", step_, config_.train.steps, val_loss);
    std::fflush(stdout);
  }
}

std::vector<StepRecord> Trainer::run() {
  const TrainSettings& t = config_.train;
  std::vector<StepRecord> records;
  if (step_ >= t.steps && options_.console) {
    fmt::print("nothing to do: at step {} of train.steps = {}\n", step_, t.steps);
  }
  while (step_ < t.steps) {
    records.push_back(train_step());
    log_step(records.back());
    bool last = step_ == t.steps;
    if (val_data_ && t.eval_interval > 0 && (step_ % t.eval_interval == 0 || last)) {
      log_eval(evaluate());
    }
    bool periodic = t.checkpoint_interval > 0 && step_ % t.checkpoint_interval == 0;
    if (t.checkpoint_interval >= 0 && (last || periodic)) {
      std::string dir = save_checkpoint();
      if (options_.console) fmt::print("checkpoint: {}\n", dir);
    }
  }
  if (options_.console) {
    fmt::print("memory: {}\n", tracker_.report());
    std::fflush(stdout);
  }
  return records;
}

}  // namespace meshtrain
