#include "meshtrain/train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <sstream>

#include "meshtrain/backend/registry.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/train/data_source.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/train/memory_check.h"
#include "meshtrain/train/memory_report.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/preference_objective.h"
#include "meshtrain/train/update_gate.h"
#include "meshtrain/util/error.h"
#include "meshtrain/train/trace_hook.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

std::string format_flops(double flops) {
  if (flops >= 1e12) return fmt::format("{:.2f} TFLOP/s", flops / 1e12);
  return fmt::format("{:.1f} GFLOP/s", flops / 1e9);
}

bool same_model(const ModelConfig& a, const ModelConfig& b) {
  return a.family == b.family && a.dim == b.dim && a.n_layers == b.n_layers &&
         a.n_heads == b.n_heads && a.n_kv_heads == b.n_kv_heads && a.hidden_dim == b.hidden_dim &&
         a.vocab_size == b.vocab_size && a.max_seq_len == b.max_seq_len &&
         a.norm_eps == b.norm_eps && a.rope_theta == b.rope_theta &&
         a.rope_scaling == b.rope_scaling && a.tie_embeddings == b.tie_embeddings &&
         a.head_dim() == b.head_dim() && a.qkv_bias == b.qkv_bias && a.qk_norm == b.qk_norm &&
         a.sliding_window == b.sliding_window;
}

// What a run leaves in out_dir: metrics, checkpoints (and their pointer).
std::vector<fs::path> run_files(const fs::path& out_dir) {
  std::vector<fs::path> found;
  if (!fs::is_directory(out_dir)) return found;
  for (const fs::directory_entry& e : fs::directory_iterator(out_dir)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("metrics") || name.starts_with("step_") || name == "latest" ||
        name == kReferenceLogpsFile) {
      found.push_back(e.path());
    }
  }
  return found;
}

}  // namespace

Trainer::Trainer(const TrainConfig& config, const TrainerOptions& options)
    : config_(config), options_(options), schedule_(config.lr_schedule()) {
  const auto constructed = std::chrono::steady_clock::now();
  // The checkpoint records the tokenizer by a path that works from any folder.
  config_.data.gpt2_ranks = fs::absolute(config_.data.gpt2_ranks).lexically_normal().string();
  const TrainSettings& t = config_.train;
  DeviceMesh* mesh = options_.mesh;
  if (mesh != nullptr) {
    options_.dp_rank = mesh->coord().dp;
    options_.dp_size = mesh->layout().dp();
    options_.console = options_.console && mesh->rank() == 0;
  }
  // One run per out_dir: before anything in it is read or written.
  out_dir_locks_ = hold_out_dir(t.out_dir, mesh != nullptr ? &mesh->world() : nullptr,
                                options_.launch_attempt > 0);
  const std::vector<std::string> resume_candidates = resolve_resume();
  resumed_from_ = resume_candidates.empty() ? "" : resume_candidates.front();
  if (mesh != nullptr) {
    check_same_config_on_all_ranks(config_, mesh->world());
    check_parallel_layout(config_.parallel, *mesh);
  }
  TrainState resumed;
  double load_ms = 0;
  if (!resumed_from_.empty()) resumed = read_resume_state(resumed_from_);

  // Data first: a bad file should fail before anything slow happens.
  train_data_ = open_sample_source(config_, expand_train_files(config_.data), true);
  LoaderOptions loader =
      rank_loader_options(t.batch_size, t.micro_batch_size, options_.dp_rank, options_.dp_size);
  if (mesh != nullptr) loader.context = ContextSplit{mesh->coord().cp, mesh->layout().cp()};
  loader.seed = t.seed;
  loader.prefetch = options_.prefetch;
  slow_ = slow_rank_delays(mesh != nullptr ? mesh->rank() : 0);
  loader.produce_delay_ms = slow_.data_ms;
  loader_options_ = loader;
  if (!config_.data.val.empty()) {
    val_data_ = open_sample_source(config_, expand_val_files(config_.data), false);
    val_set_ = std::make_unique<ValidationSet>(*val_data_, loader, t.eval_batches);
  }
  loader_ = std::make_unique<DataLoader>(*train_data_, loader, resumed.sampler);
  // Fail before allocating: every rank's predicted peak against its host's
  // limits (without a mesh a parallel layout fails below with its own message).
  const ParallelSettings& parallel = config_.parallel;
  if (mesh != nullptr || (parallel.tp == 1 && parallel.pp == 1)) {
    memory_plan_ = predict_run_memory(config_, mesh != nullptr ? mesh->size() : 1);
    check_memory_before_allocating(config_, memory_plan_, mesh, options_.console);
  }
  backend_ = make_backend(t.device, t.threads, tracker_);

  // The parallel modes, composed: the stage and tp slice the model holds, the
  // data parallelism that owns its gradients and optimizer state, the runner
  // of the step's micro-batches, the checkpointer reading their layout.
  const int64_t micro_batches = loader_->micro_batches_per_step();
  TensorParallel tp;
  if (mesh != nullptr) tp = TensorParallel{&mesh->tp(), config_.parallel.sequence_parallel};
  ExpertParallel ep;
  if (mesh != nullptr) ep = ExpertParallel{&mesh->ep()};
  model_ = std::make_unique<Model>(config_.model, t.precision, *backend_,
                                   data_parallel_storage(config_), tp,
                                   stage_of(config_, mesh, micro_batches), ep);
  model_->set_recompute({t.recompute, t.recompute_layers});
  if (mesh != nullptr) {
    model_->set_context_parallel(
        ContextParallel{&mesh->cp(), parse_cp_comm(config_.parallel.cp_comm)});
  }
  dp_ = make_data_parallel(config_, *model_, mesh, config_.parallel.pp > 1 ? micro_batches : 0);
  prepare_out_dir();  // after the layout checks: a bad layout is named first
  checkpointer_ = std::make_unique<Checkpointer>(config_, mesh, *model_, *dp_, tracker_);
  gates_ = make_update_gates(config_, mesh != nullptr ? &mesh->world() : nullptr);
  // A QLoRA run rebuilds its NF4 base from train.init_from on resume and
  // export: its checkpoints record the directory's digest (rank 0 reads it;
  // after the data and layout checks: it reads the whole base).
  if (config_.model.lora.quantize_base != BaseQuant::none && !t.init_from.empty()) {
    if (mesh == nullptr || mesh->rank() == 0) base_digest_ = weights_digest(t.init_from);
    if (mesh != nullptr) mesh->world().broadcast(&base_digest_, 1, CommDType::i64, 0);
    check_base_digest(t.init_from, base_digest_, resumed.base_digest,
                      fmt::format("checkpoint '{}'", resumed_from_));
  }
  auto start_weights = [&] {
    dp_->init_weights(t.seed);
    if (!t.init_from.empty()) checkpointer_->load_weights(t.init_from, *backend_);
  };
  // A QLoRA run's NF4 base is not checkpoint state (ParamSpec::nf4): rebuilt
  // as the run started, exactly, before a resume's load fills in the rest.
  if (!resumed_from_.empty() && model_->holds_nf4()) start_weights();
  if (!resumed_from_.empty() && options_.resume_dir == "auto") {
    // Checksums are computed while loading: a corrupt file falls back to the
    // next candidate (every rank agreeing), none left to a fresh start.
    std::vector<std::string> skipped;
    const std::string loaded = checkpointer_->load_newest(resume_candidates, skipped);
    if (options_.console) {
      for (const std::string& note : skipped) fmt::print("resume: {}\n", note);
      if (!skipped.empty()) {
        fmt::print("resume auto: {}\n", loaded.empty() ? "no checkpoint loads, starting fresh"
                                                        : "falling back to " + loaded);
      }
    }
    if (loaded != resumed_from_) {
      resumed_from_ = loaded;
      resumed = loaded.empty() ? TrainState{} : read_resume_state(loaded);
      loader_.reset();  // joins its prefetch thread before the new one starts
      loader_ = std::make_unique<DataLoader>(*train_data_, loader, resumed.sampler);
    }
    if (loaded.empty()) {
      options_.overwrite = true;
      prepare_out_dir();
      checkpointer_->reset_optimizer_state();
    }
  } else if (!resumed_from_.empty()) {
    checkpointer_->load(resumed_from_);
  }
  if (resumed_from_.empty()) {
    start_weights();
  } else {
    load_ms = checkpointer_->last_load_seconds() * 1e3;
    dp_->set_step_count(resumed.optimizer_step);
    gates_->load_state(resumed.update_gates, resumed_from_);
    step_ = resumed.step;
  }
  objective_ = make_step_objective(config_, *model_, *train_data_, val_set_.get(), loader, mesh);
  runner_ = make_step_runner(config_, *model_, mesh, micro_batches, loader.micro_batch,
                             objective_.get());
  if (objective_) {
    objective_->start(*runner_, !resumed_from_.empty());
    dp_->quiesce();  // ZeRO 3: frees what its passes gathered
  }
  std::string metrics_path = (fs::path(t.out_dir) / metrics_file_name(mesh ? mesh->rank() : 0)).string();
  // A resumed run appends to the trace of the run it continues.
  auto metrics = std::make_unique<MetricsLog>(metrics_path, !resumed_from_.empty(), config_.train,
                                              options_.console, dp_->group() != nullptr);
  metrics_ = metrics.get();
  hooks_.push_back(std::move(metrics));
  if (t.straggler_interval > 0 && mesh != nullptr && mesh->world().size() > 1) {
    hooks_.push_back(std::make_unique<StragglerHook>(mesh->world(), *metrics_, t.straggler_interval,
                                                     t.straggler_threshold, options_.console));
  }
  if (!t.trace_steps.empty()) hooks_.push_back(std::make_unique<TraceHook>(t.trace_steps, t.out_dir, mesh));

  if (t.peak_flops > 0) {
    peak_flops_ = t.peak_flops;
    peak_source_ = "from train.peak_flops";
  } else {
    DType dtype = compute_dtype(t.precision);
    peak_flops_ = backend_->measure_matmul_peak_flops(dtype);
    peak_source_ = fmt::format("measured: {} oneDNN matmul, {} threads", dtype_name(dtype),
                               backend_->threads());
  }
  if (options_.console) print_setup(loader);
  if (!resumed_from_.empty()) {
    // Each restart shows in the metrics: where from, and what it cost (the
    // steps between this checkpoint and the failure are redone).
    nlohmann::json event{{"event", "resume"}, {"from", resumed_from_}, {"step", step_},
                         {"load_ms", load_ms}, {"load_bytes", checkpointer_->last_load_bytes()},
                         {"setup_ms", std::chrono::duration<double, std::milli>(
                                          std::chrono::steady_clock::now() - constructed)
                                          .count()}};
    if (options_.launch_attempt > 0) {
      event["attempt"] = options_.launch_attempt;
      const double now = std::chrono::duration<double>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
      if (options_.launched_at > 0) event["since_launch_ms"] = (now - options_.launched_at) * 1e3;
    }
    metrics_->write(event);
  }
  log_memory("start");
}

// A pending asynchronous save finishes in the checkpointer's destructor.
Trainer::~Trainer() = default;

std::vector<std::string> Trainer::resolve_resume() {
  if (options_.resume_dir != "auto") {
    if (options_.resume_dir.empty()) return {};
    return {options_.resume_dir};
  }
  const std::vector<std::string> chosen = checkpoint_candidates(true);
  if (options_.console) {
    fmt::print("resume auto: {}\n", chosen.empty() ? "no valid checkpoint, starting fresh"
                                                   : "from " + chosen.front());
  }
  if (chosen.empty()) options_.overwrite = true;  // nothing to continue: a fresh run
  return chosen;
}

std::vector<std::string> Trainer::checkpoint_candidates(bool report) {
  // Rank 0 lists them; every rank takes its list.
  std::string listed;
  if (options_.mesh == nullptr || options_.mesh->rank() == 0) {
    std::optional<dist_ckpt::ResumeChoice> choice =
        dist_ckpt::find_resume_checkpoint(config_.train.out_dir);
    if (choice) {
      listed = choice->dir;
      for (const std::string& dir : choice->fallbacks) listed += "\n" + dir;
      if (report && options_.console) {
        for (const std::string& note : choice->notes) fmt::print("resume: {}\n", note);
      }
    }
  }
  if (options_.mesh != nullptr) listed = broadcast_string(options_.mesh->world(), listed, 0);
  std::vector<std::string> out;
  std::istringstream lines(listed);
  for (std::string line; std::getline(lines, line);) out.push_back(line);
  return out;
}

TrainState Trainer::read_resume_state(const std::string& dir) const {
  TrainConfig saved;
  TrainState state = read_train_state(dir, &saved);
  MESHTRAIN_CHECK(same_model(saved.model, config_.model),
                  "resume: the model in '{}' differs from the configured [model]", dir);
  const std::vector<std::string> changes = resume_config_changes(saved, config_);
  MESHTRAIN_CHECK(changes.empty() || options_.allow_config_change,
                  "resume: '{}' was trained with other settings that break exact continuation "
                  "({}); pass --allow-config-change to resume anyway",
                  dir, fmt::join(changes, "; "));
  return state;
}

int64_t Trainer::next_batch_number() const {
  const SamplerPosition p = loader_->position();
  return p.epoch * loader_->order().batches_per_epoch() + p.index / config_.train.batch_size + 1;
}

void Trainer::roll_back(const RollbackRequest& request, StepRecord& r) {
  checkpointer_->wait();  // a checkpoint being written is the newest good one
  std::vector<std::string> candidates = checkpoint_candidates(false);
  // Nothing saved yet in out_dir: where this run began.
  if (candidates.empty() && !resumed_from_.empty()) candidates.push_back(resumed_from_);
  std::vector<std::string> skipped;
  const std::string dir = candidates.empty() ? "" : checkpointer_->load_newest(candidates, skipped);
  MESHTRAIN_CHECK_AS(ErrorKind::diverged, !dir.empty(),
                     "step {}: {}; no checkpoint in '{}' to roll back to (train.checkpoint_interval "
                     "saves them): training diverged",
                     r.step, request.reason, config_.train.out_dir);
  // The data continues past this step's batch (already read) and skip_batches more.
  SamplerPosition data = loader_->position();
  for (int64_t i = 0; i < request.skip_batches; ++i) data = loader_->order().next_batch(data);
  const TrainState saved = read_train_state(dir);
  dp_->set_step_count(saved.optimizer_step);
  gates_->load_state(saved.update_gates, dir);
  step_ = saved.step;
  loader_.reset();  // joins its prefetch thread before the new one starts
  loader_ = std::make_unique<DataLoader>(*train_data_, loader_options_, data);
  const int64_t batches = loader_->order().batches_per_epoch();
  r.rolled_back = true;
  r.rollback_to_step = saved.step;
  r.rollback_skipped_batches = next_batch_number() - 1 -
                               (saved.sampler.epoch * batches +
                                saved.sampler.index / config_.train.batch_size);
  r.rollback_reason = request.reason;
  r.rollback_checkpoint = dir;
}

void Trainer::prepare_out_dir() {
  const fs::path out_dir(config_.train.out_dir);
  Communicator* world = options_.mesh != nullptr ? &options_.mesh->world() : nullptr;
  if (resumed_from_.empty()) {
    // Every rank looks before any rank deletes or writes.
    const std::vector<fs::path> old = run_files(out_dir);
    MESHTRAIN_CHECK(old.empty() || options_.overwrite,
                    "train.out_dir '{}' holds another run ({}); resume it (--resume auto), choose "
                    "another out_dir, or pass --overwrite to delete it",
                    out_dir.string(), old.front().filename().string());
    if (world != nullptr) world->barrier();
    if (world == nullptr || world->rank() == 0) {
      for (const fs::path& p : old) fs::remove_all(p);
    }
  }
  fs::create_directories(out_dir);
  if (world != nullptr) world->barrier();
}

void Trainer::print_setup(const LoaderOptions& loader) {
  const TrainSettings& t = config_.train;
  const ModelConfig& m = config_.model;
  fmt::print("model: {} {}dim {}, {} layers, {} heads ({} kv), hidden {}, vocab {}: {} params\n",
             family_name(m.family),
             config_.model_preset.empty() ? "" : fmt::format("({}) ", config_.model_preset), m.dim,
             m.n_layers, m.n_heads, m.n_kv_heads, m.hidden_dim, m.vocab_size,
             model_->num_params());
  fmt::print("train: {} steps, {} x {} = {} tokens per step ({}{} micro-batches of {}), {}, "
             "{} threads\n",
             t.steps, t.batch_size, t.seq_len, t.tokens_per_step(),
             options_.dp_size > 1
                 ? fmt::format("dp rank {} of {}: ", options_.dp_rank, options_.dp_size)
                 : "",
             loader_->micro_batches_per_step(), loader.micro_batch, precision_name(t.precision),
             backend_->threads());
  if (options_.mesh != nullptr) {
    fmt::print("parallel: {} ({} threads per rank); {}\n", options_.mesh->layout().describe(),
               backend_->threads(), dp_->describe());
    fmt::print("{}", runner_->describe());
    const TensorParallel& tp = model_->tensor_parallel();
    if (tp.active()) {
      fmt::print("tensor parallel: tp {}, sequence parallel {}; {} parameters on this rank\n",
                 tp.size(), tp.sequence_parallel ? "on" : "off", model_->num_params());
    }
  }
  const GlobalOrder& order = loader_->order();
  fmt::print("data: {}, {} steps per epoch ({:.2f} epochs){}\n", train_data_->describe(),
             order.batches_per_epoch(),
             static_cast<double>(t.steps) / static_cast<double>(order.batches_per_epoch()),
             val_data_ ? fmt::format("; val {}, {} sequences per validation",
                                     val_data_->describe(), t.eval_batches * t.batch_size)
                       : "");
  fmt::print("MFU peak: {} ({})\n", format_flops(peak_flops_), peak_source_);
  if (!resumed_from_.empty()) {
    fmt::print("resumed from {} at step {} (epoch {}, sample {})\n", resumed_from_, step_,
               loader_->position().epoch, loader_->position().index);
  }
  std::fflush(stdout);
}

void Trainer::add_hook(std::unique_ptr<StepHook> hook) { hooks_.push_back(std::move(hook)); }

void Trainer::log_memory(const char* when) {
  // Expert parallelism: the expert side's buffers at the most rows the
  // routing so far gave any rank's experts (basis "measured routing"), not
  // at the balanced load the start-up check used. Every rank logs together.
  if (config_.parallel.ep > 1 && model_ != nullptr) {
    int64_t rows = model_->max_expert_rows();
    DeviceMesh* mesh = options_.mesh;
    if (mesh != nullptr) mesh->world().all_reduce(&rows, 1, CommDType::i64, ReduceOp::max);
    if (rows > 0) {
      memory_plan_ = predict_run_memory(config_, mesh != nullptr ? mesh->size() : 1, rows);
    }
  }
  report_memory(when, step_, tracker_, memory_plan_, options_.mesh, *metrics_, options_.console);
}

StepRecord Trainer::train_step() {
  const TrainSettings& t = config_.train;
  auto start = std::chrono::steady_clock::now();
  // Each loss token weighs 1/(loss tokens of the whole step): the gradient of
  // the step's mean over every micro-batch and replica (the dp x cp
  // replicas' gradients are averaged, hence the factor dp x cp). The loader
  // counts the global batch, so every rank knows it before backward without
  // a collective. Token shards: every token, tokens_per_step.
  const int64_t loss_tokens = loader_->step_loss_tokens();
  const int64_t replicas = options_.dp_size * loader_options_.context.size;
  const double per_rank = static_cast<double>(std::max<int64_t>(1, loss_tokens)) /
                          static_cast<double>(replicas);
  const float grad_scale = 1.0f / static_cast<float>(per_rank);
  const TensorParallel& tp = model_->tensor_parallel();
  const uint64_t tp_bytes = tp.active() ? tp.comm->stats().total().bytes : 0;
  const ExpertParallel& ep = model_->expert_parallel();
  const OpStats ep_before = ep.active() ? ep.comm->stats().total() : OpStats{};
  const double data_wait = loader_->stats().wait_seconds;

  StepRecord r;
  r.step = step_ + 1;
  trace::Span step_span("step", "step", r.step);
  // The loss gradient carries the gates' loss scale (fp16); the gradients are
  // unscaled in the norm and in the update's multiplier, never in a pass of their own.
  const double loss_scale = gates_->loss_scale();
  const int64_t batch = next_batch_number();
  dp_->begin_step();
  model_->reset_moe_stats();
  sleep_ms(slow_.compute_ms);  // before the gradients: its peers wait for them in the sync
  double loss_sum =
      runner_->run(*loader_, *dp_, static_cast<float>(grad_scale * loss_scale), r);
  trace::Span sync_span("step", "gradient sync");
  dp_->finish_gradient_sync();
  sync_span.end();
  inject_grad_fault(*dp_, batch, options_.mesh != nullptr ? options_.mesh->rank() : 0);
  if (Communicator* group = dp_->group()) loss_sum = sum_over_ranks(*group, loss_sum);
  r.moe = moe_step_records(*model_, *dp_);
  r.loss_tokens = loss_tokens;
  r.loss = loss_sum / static_cast<double>(std::max<int64_t>(1, loss_tokens));
  // Each element counted once across tp, stages and shards.
  trace::Span norm_span("step", "grad norm");
  r.grad_norm = dp_->grad_norm(runner_->stages()) / loss_scale;
  norm_span.end();
  // Every rank takes the same decision (one collective over the world).
  const auto gates_start = std::chrono::steady_clock::now();
  const GateDecision decision = gates_->decide({r.step, r.loss, r.grad_norm});
  r.gates_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - gates_start)
          .count();
  gates_->fill(decision, loss_scale, r);
  r.lr = schedule_.at(step_);
  if (decision.apply) {
    // Non-finite values no gate took responsibility for (fp32, bf16).
    MESHTRAIN_CHECK(std::isfinite(r.loss), "step {}: loss is {}: training diverged", r.step,
                    r.loss);
    MESHTRAIN_CHECK(std::isfinite(r.grad_norm), "step {}: gradient norm is {}: training diverged",
                    r.step, r.grad_norm);
    const auto optimizer_start = std::chrono::steady_clock::now();
    trace::Span optimizer_span("step", "optimizer");
    sleep_ms(slow_.optimizer_ms);
    dp_->step(r.lr, static_cast<float>(clip_factor(r.grad_norm, t.grad_clip) / loss_scale), r);
    update_moe_balancing(*model_, *dp_, r.moe);
    r.optimizer_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                               optimizer_start)
                         .count();
  }
  ++step_;  // a skipped step still consumed its batch and its LR

  if (tp.active()) r.tp_comm_bytes = tp.comm->stats().total().bytes - tp_bytes;
  if (ep.active()) {
    const OpStats ep_after = ep.comm->stats().total();
    r.ep_comm_bytes = ep_after.bytes - ep_before.bytes;
    r.ep_comm_ms = (ep_after.busy_seconds - ep_before.busy_seconds) * 1e3;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto tokens = static_cast<double>(t.tokens_per_step());
  r.step_ms = seconds * 1e3;
  r.data_ms = (loader_->stats().wait_seconds - data_wait) * 1e3;
  r.tokens_per_s = tokens / seconds;
  // Per rank: this rank's share of the FLOPs (tp ranks split each token's, a
  // pipeline stage runs 1 / pp of the layers as balanced, cp ranks 1 / cp of
  // each sequence) against its peak.
  r.mfu = config_.model.train_flops_per_token(t.seq_len) * tokens /
          static_cast<double>(replicas * tp.size() * config_.parallel.pp) / seconds /
          peak_flops_;
  // After the step's figures: the rollback replaces the loader.
  if (decision.rollback) roll_back(*decision.rollback, r);
  return r;
}

double Trainer::evaluate() {
  MESHTRAIN_CHECK(val_set_ != nullptr, "evaluate: no validation data (data.val)");
  trace::Span span("step", "evaluate");
  // Always the same leading windows, so successive values are comparable.
  int64_t tokens = 0;
  double loss_sum = runner_->evaluate(*val_set_, tokens);
  if (Communicator* group = dp_->group()) {
    loss_sum = sum_over_ranks(*group, loss_sum);
    tokens = static_cast<int64_t>(sum_over_ranks(*group, static_cast<double>(tokens)));
  }
  dp_->quiesce();  // ZeRO 3: frees what the evaluation gathered
  return loss_sum / static_cast<double>(tokens);
}

std::string Trainer::save_checkpoint() {
  TrainState state;
  state.step = step_;
  state.optimizer_step = dp_->step_count();
  state.sampler = loader_->position();
  state.seed = config_.train.seed;
  state.update_gates = gates_->state();
  state.base_digest = base_digest_;
  return checkpointer_->save(state);
}

void Trainer::wait_for_checkpoint() { checkpointer_->wait(); }

std::string Trainer::checkpoint_now() {
  const std::string dir = save_checkpoint();
  checkpointer_->wait();
  for (auto& hook : hooks_) hook->on_checkpoint(step_, dir);
  return dir;
}

void Trainer::log_event(const nlohmann::json& record) { metrics_->write(record); }

std::vector<float> Trainer::gather_state(layout::StateKind kind) {
  return checkpointer_->gather(kind);
}

std::vector<StepRecord> Trainer::run() {
  const TrainSettings& t = config_.train;
  std::vector<StepRecord> records;
  if (step_ >= t.steps && options_.console) {
    fmt::print("nothing to do: at step {} of train.steps = {}\n", step_, t.steps);
  }
  while (step_ < t.steps) {
    for (auto& hook : hooks_) hook->before_step(step_ + 1);
    records.push_back(train_step());
    for (auto& hook : hooks_) hook->on_step(records.back());
    // Back at a checkpoint's step: its evaluation and checkpoint were done.
    if (records.back().rolled_back) continue;
    const bool last = step_ == t.steps;
    if (val_set_ && t.eval_interval > 0 && (step_ % t.eval_interval == 0 || last)) {
      const double val_loss = evaluate();
      for (auto& hook : hooks_) hook->on_eval(step_, val_loss);
    }
    const bool periodic = t.checkpoint_interval > 0 && step_ % t.checkpoint_interval == 0;
    if (t.checkpoint_interval >= 0 && (last || periodic)) {
      const std::string dir = save_checkpoint();
      if (last) checkpointer_->wait();  // the run ends with its checkpoint committed
      for (auto& hook : hooks_) hook->on_checkpoint(step_, dir);
    }
  }
  for (auto& hook : hooks_) hook->on_end();
  log_memory("end");
  return records;
}

}  // namespace meshtrain
