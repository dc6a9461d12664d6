#include "meshtrain/train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/distributed.h"
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

// The tp = 1 parameter list (whole tensors at their flat offsets): the
// checkpoint layout whatever the tensor parallelism.
std::vector<Parameter> full_layout(const ModelConfig& config) {
  std::vector<Parameter> params;
  int64_t offset = 0;
  for (ParamSpec& spec : build_param_specs(config)) {
    Parameter p;
    p.offset = offset;
    offset += spec.numel();
    p.spec = std::move(spec);
    params.push_back(std::move(p));
  }
  return params;
}

// Three f32 workspace tensors of `numel` elements (master, exp_avg, exp_avg_sq).
CheckpointTensors workspace_state(int64_t numel, MemoryTracker& tracker) {
  const Shape shape{numel};
  return {Tensor(shape, DType::f32, MemCategory::workspace, tracker),
          Tensor(shape, DType::f32, MemCategory::workspace, tracker),
          Tensor(shape, DType::f32, MemCategory::workspace, tracker)};
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
  if (options_.mesh != nullptr) {
    DeviceMesh& mesh = *options_.mesh;
    check_same_config_on_all_ranks(config_, mesh.world());
    check_parallel_layout(config_.parallel, mesh);
    options_.dp_rank = mesh.coord().dp;
    options_.dp_size = mesh.layout().dp();
    options_.console = options_.console && mesh.rank() == 0;
  }
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
  LoaderOptions loader;
  loader.global_batch = t.batch_size;
  // With dp ranks, each runs batch_size / dp rows per step, in micro-batches
  // of at most micro_batch_size.
  loader.micro_batch = std::min(t.micro_batch_size, std::max<int64_t>(1, t.batch_size / options_.dp_size));
  loader.dp_rank = options_.dp_rank;
  loader.dp_size = options_.dp_size;
  loader.seed = t.seed;
  loader.prefetch = options_.prefetch;
  if (!config_.data.val.empty()) {
    val_data_ = std::make_unique<TokenDataset>(expand_val_files(config_.data),
                                               config_.model.vocab_size, t.seq_len);
    val_set_ = std::make_unique<ValidationSet>(*val_data_, loader, t.eval_batches);
  }
  loader_ = std::make_unique<DataLoader>(*train_data_, loader, resumed.sampler);

  ctx_ = std::make_unique<cpu::CpuContext>(t.threads, tracker_);
  const bool sharded = config_.parallel.zero > 0;
  MESHTRAIN_CHECK(!sharded || options_.mesh != nullptr,
                  "parallel.zero = {} needs a communicator: run through `meshtrain train` (or "
                  "pass TrainerOptions::mesh)",
                  config_.parallel.zero);
  const int pp = config_.parallel.pp;
  pipeline::PipelineShape shape{pp, static_cast<int>(loader_->micro_batches_per_step()),
                                config_.parallel.virtual_stages};
  const pipeline::ScheduleKind kind = pipeline::parse_schedule_kind(config_.parallel.schedule);
  StageLayers stage;
  if (pp > 1) {
    MESHTRAIN_CHECK(options_.mesh != nullptr,
                    "parallel.pp = {} needs a communicator: run through `meshtrain train` (or "
                    "pass TrainerOptions::mesh)",
                    pp);
    pipeline::check_shape(kind, shape);
    pp_split_ = pp_split_layers(config_.parallel);
    stage = pipeline::stage_layers(config_.model.n_layers, shape, options_.mesh->coord().pp,
                                   pp_split_);
  }
  TensorParallel tp;
  if (options_.mesh != nullptr) {
    tp = TensorParallel{&options_.mesh->tp(), config_.parallel.sequence_parallel};
  }
  model_ = std::make_unique<Model>(config_.model, t.precision, *ctx_,
                                   sharded ? ParamStorage::external : ParamStorage::flat, tp,
                                   stage);
  if (sharded) {
    zero::ZeroOptions zero_opts = zero_options(config_);
    // Pipelines: each unit's gradients reduced once, after its last backward.
    if (pp > 1) zero_opts.pipeline_micro_batches = shape.micro_batches;
    zero_ = std::make_unique<zero::ShardedDataParallel>(*model_, options_.mesh->dp(),
                                                        config_.optim.adamw, zero_opts);
  } else {
    optimizer_ = std::make_unique<AdamW>(*model_, config_.optim.adamw);
  }
  if (options_.resume_dir.empty()) {
    if (zero_) {
      zero_->init_weights(t.seed);
    } else {
      model_->init_weights(t.seed);
    }
  } else {
    load_state(options_.resume_dir);
    if (zero_) {
      zero_->set_step_count(resumed.optimizer_step);
    } else {
      optimizer_->set_step_count(resumed.optimizer_step);
    }
    step_ = resumed.step;
  }
  if (!sharded && options_.mesh != nullptr && options_.dp_size > 1) {
    // Pipelines reduce once, after the schedule's last backward.
    ddp_ = std::make_unique<DistributedDataParallel>(
        *model_, options_.mesh->dp(),
        DdpOptions{config_.parallel.bucket_mb, config_.parallel.overlap && pp == 1});
  }
  if (pp > 1) {
    Communicator& pp_group = options_.mesh->pp();
    pipeline_ = std::make_unique<pipeline::Executor>(*model_, pp_group, kind, shape,
                                                     loader.micro_batch, t.seq_len);
    if (config_.model.tie_embeddings) {
      const bool ends = stage.first || stage.last;
      tied_ = pp_group.split(ends ? 0 : 1, pp_group.rank(), "pp_tied");
      if (!ends) tied_.reset();  // the middle stages' group is not used
    }
  }

  fs::create_directories(t.out_dir);
  std::string metrics_path = (fs::path(t.out_dir) / metrics_file_name(options_.mesh ? options_.mesh->rank() : 0)).string();
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
    fmt::print("train: {} steps, {} x {} = {} tokens per step ({}{} micro-batches of {}), {}, "
               "{} threads\n",
               t.steps, t.batch_size, t.seq_len, t.tokens_per_step(),
               options_.dp_size > 1 ? fmt::format("dp rank {} of {}: ", options_.dp_rank,
                                                  options_.dp_size)
                                    : "",
               loader_->micro_batches_per_step(), loader.micro_batch, precision_name(t.precision),
               ctx_->threads());
    if (options_.mesh != nullptr) {
      fmt::print("parallel: {} ({} threads per rank); {}\n", options_.mesh->layout().describe(),
                 ctx_->threads(),
                 zero_  ? describe_zero(*zero_)
                 : ddp_ ? fmt::format("DDP: {} gradient buckets of <= {} MiB, overlap {}",
                                      ddp_->buckets().size(), config_.parallel.bucket_mb,
                                      config_.parallel.overlap ? "on" : "off")
                        : "no gradient sync (dp 1)");
      if (pipeline_) {
        const auto ranges = pipeline::split_layers(config_.model.n_layers, shape.total_stages(),
                                                   pp_split_);
        std::string layers;
        for (const auto& [first, end] : ranges) {
          layers += fmt::format("{}{}", layers.empty() ? "" : ",", end - first);
        }
        fmt::print("pipeline: {} stages x {} virtual, schedule {}, {} micro-batches per step, "
                   "layers per stage {}, theoretical bubble {:.3f}\n",
                   shape.stages, shape.virtual_stages, pipeline::schedule_kind_name(kind),
                   shape.micro_batches, layers, pipeline::theoretical_bubble(shape));
        // The schedule as the simulator runs it (backward = 2 forward).
        fmt::print("{}", pipeline::format_timeline(
                             pipeline::simulate(pipeline::make_schedule(kind, shape), shape), shape));
      }
      if (tp.active()) {
        fmt::print("tensor parallel: tp {}, sequence parallel {}; {} parameters on this rank\n",
                   tp.size(), tp.sequence_parallel ? "on" : "off", model_->num_params());
      }
    }
    const GlobalOrder& order = loader_->order();
    fmt::print("data: {} tokens, {} samples of {} (+1) tokens, {} steps per epoch ({:.2f} epochs)"
               "{}\n",
               train_data_->num_tokens(), train_data_->num_samples(), t.seq_len,
               order.batches_per_epoch(),
               static_cast<double>(t.steps) / static_cast<double>(order.batches_per_epoch()),
               val_data_ ? fmt::format("; val {} tokens, {} sequences per validation",
                                       val_data_->num_tokens(), t.eval_batches * t.batch_size)
                         : "");
    fmt::print("MFU peak: {} ({})\n", format_flops(peak_flops_), peak_source_);
    if (!options_.resume_dir.empty()) {
      fmt::print("resumed from {} at step {} (epoch {}, sample {})\n", options_.resume_dir, step_,
                 resumed.sampler.epoch, resumed.sampler.index);
    }
    std::fflush(stdout);
  }
  log_memory("start");
}

Trainer::~Trainer() = default;

AdamW& Trainer::optimizer() {
  MESHTRAIN_CHECK(optimizer_ != nullptr,
                  "trainer: with parallel.zero = {} the optimizer state is sharded (zero())",
                  config_.parallel.zero);
  return *optimizer_;
}

void Trainer::load_state(const std::string& dir) {
  // Without ZeRO the state lands in the model's and the optimizer's buffers;
  // with it in workspace, from which every rank keeps its shards.
  CheckpointTensors local =
      zero_ ? workspace_state(model_->num_params(), tracker_)
            : CheckpointTensors{model_->flat_master(), optimizer_->exp_avg(),
                                optimizer_->exp_avg_sq()};
  if (model_->tensor_parallel().active() || config_.parallel.pp > 1) {
    load_sliced_state(dir, local);
  } else {
    load_checkpoint_tensors(dir, model_->params(), local);
  }
  if (!zero_) {
    model_->sync_compute_weights();
    return;
  }
  using State = zero::ShardedDataParallel::State;
  zero_->load_full(State::master, local.master.data<float>());
  zero_->load_full(State::exp_avg, local.exp_avg.data<float>());
  zero_->load_full(State::exp_avg_sq, local.exp_avg_sq.data<float>());
}

// Tensor parallel or a pipeline stage: every rank reads the whole tensors and
// keeps its slices and its stage's parameters. Runs before pipeline_ exists:
// the layout comes from the config.
void Trainer::load_sliced_state(const std::string& dir, CheckpointTensors& local) {
  const std::vector<Parameter> full = full_layout(config_.model);
  CheckpointTensors whole =
      workspace_state(full.back().offset + full.back().spec.numel(), tracker_);
  load_checkpoint_tensors(dir, full, whole);
  const std::vector<TensorSplit> splits = tp_local_splits();
  // A pipeline stage takes its parameters from the whole model's tp slices.
  const bool stage = config_.parallel.pp > 1;
  Tensor sliced = stage ? Tensor({local_flat_numel(splits)}, DType::f32, MemCategory::workspace,
                                 tracker_)
                        : Tensor();
  for (auto [from, to] : {std::pair{&whole.master, &local.master},
                          {&whole.exp_avg, &local.exp_avg},
                          {&whole.exp_avg_sq, &local.exp_avg_sq}}) {
    if (!stage) {
      scatter_tp_flat(splits, from->data<float>(), to->data<float>());
      continue;
    }
    scatter_tp_flat(splits, from->data<float>(), sliced.data<float>());
    pipeline::select_stage(*model_, sliced.data<float>(), to->data<float>());
  }
}

std::vector<float> Trainer::gather_weights() {
  std::vector<float> weights;
  if (zero_) {
    // The shards (of this stage) first.
    weights.resize(static_cast<size_t>(model_->num_params()));
    zero_->gather_full(zero::ShardedDataParallel::State::master, 0, weights.data());
    zero_->dp().broadcast(weights.data(), static_cast<int64_t>(weights.size()), CommDType::f32, 0);
  }
  if (pipeline_) {
    // The stages' tp-local flats assembled, then (below) the tp slices.
    Communicator& pp = options_.mesh->pp();
    weights = pipeline::gather_stages(pp, *model_, pipeline_->shape(), pp_split_,
                                      zero_ ? weights.data() : model_->flat_master().data<float>(),
                                      0);
    int64_t n = static_cast<int64_t>(weights.size());
    pp.broadcast(&n, 1, CommDType::i64, 0);
    weights.resize(static_cast<size_t>(n));
    pp.broadcast(weights.data(), n, CommDType::f32, 0);
  } else if (!zero_) {
    const Tensor& w = model_->flat_master();
    weights.assign(w.data<float>(), w.data<float>() + w.numel());
  }
  const TensorParallel& tp = model_->tensor_parallel();
  if (!tp.active()) return weights;
  const std::vector<TensorSplit> splits = tp_local_splits();
  std::vector<float> full(static_cast<size_t>(full_flat_numel(splits)));
  gather_tp_flat(tp, splits, weights.data(), full.data());
  return full;
}

void Trainer::log_memory(const char* when) {
  const MemorySnapshot mine = tracker_.snapshot();
  nlohmann::json bytes;
  for (size_t c = 0; c < kMemCategories; ++c) {
    const std::string name(mem_category_name(static_cast<MemCategory>(c)));
    bytes[name] = mine.live[c];
    bytes[name + "_peak"] = mine.peak[c];
  }
  bytes["total"] = mine.live_total;
  bytes["total_peak"] = mine.peak_total;
  metrics_ << nlohmann::json{{"step", step_}, {"memory", when}, {"bytes", bytes}}.dump() << '\n';
  metrics_.flush();
  // Collective: every rank takes part, rank 0 prints.
  const bool ranks = options_.mesh != nullptr && options_.mesh->world().size() > 1;
  const MemorySnapshot max = ranks ? max_over_ranks(options_.mesh->world(), mine) : mine;
  if (options_.console) {
    fmt::print("memory at {}: {}\n", when, mine.report());
    if (ranks) {
      fmt::print("memory at {}, max over {} ranks: {}\n", when, options_.mesh->world().size(),
                 max.report());
    }
    std::fflush(stdout);
  }
}

StepRecord Trainer::train_step() {
  const TrainSettings& t = config_.train;
  auto start = std::chrono::steady_clock::now();
  const int64_t seq = t.seq_len;
  // Each token's loss weighs 1/tokens-per-step: the gradient of the step's
  // mean (with dp ranks: of this rank's share, averaged over ranks by DDP).
  const float grad_scale = 1.0f / static_cast<float>(t.tokens_per_step() / options_.dp_size);

  const TensorParallel& tp = model_->tensor_parallel();
  const uint64_t tp_bytes = tp.active() ? tp.comm->stats().total().bytes : 0;
  if (!zero_) model_->zero_grads();
  double loss_sum = 0;
  double data_seconds = loader_->stats().wait_seconds;
  const int64_t micro_batches = loader_->micro_batches_per_step();
  StepRecord r;
  if (pipeline_ && zero_) zero_->begin_micro_batch(true, true);  // ZeRO counts backwards from here
  if (pipeline_) loss_sum = pipeline_micro_batches(grad_scale, r);
  for (int64_t a = 0; a < micro_batches && !pipeline_; ++a) {
    const MicroBatch& batch = loader_->next();
    if (ddp_) ddp_->begin_micro_batch(a + 1 == micro_batches);
    if (zero_) zero_->begin_micro_batch(a == 0, a + 1 == micro_batches);
    loss_sum += model_->forward_backward(batch.inputs.data(), batch.targets.data(), batch.rows,
                                         seq, grad_scale);
  }
  data_seconds = loader_->stats().wait_seconds - data_seconds;
  if (pipeline_) loss_sum = sum_over_ranks(options_.mesh->pp(), loss_sum);
  if (ddp_) {
    if (pipeline_) ddp_->begin_micro_batch(true);  // the one reduction, after the schedule
    ddp_->finish_gradient_sync();
    loss_sum = sum_over_ranks(ddp_->dp(), loss_sum);
    r.comm_ms = ddp_->last_sync().comm_seconds * 1e3;
    r.exposed_comm_ms = ddp_->last_sync().exposed_seconds * 1e3;
    for (const CallRecord& call : ddp_->last_sync().calls) r.comm_bytes += call.bytes;
  }
  if (zero_) {
    zero_->finish_gradient_sync();
    loss_sum = sum_over_ranks(zero_->dp(), loss_sum);
  }
  r.step = step_ + 1;
  r.loss = loss_sum / static_cast<double>(t.tokens_per_step());
  MESHTRAIN_CHECK(std::isfinite(r.loss), "step {}: loss is {}: training diverged", r.step, r.loss);
  // Each element counted once across tp (and pp: a tied copy once).
  r.grad_norm = zero_       ? zero_->grad_norm(pipeline_ ? &options_.mesh->pp() : nullptr)
                : pipeline_ ? pipeline::pipeline_grad_norm(*model_, options_.mesh->pp())
                            : tensor_parallel_grad_norm(*model_);
  MESHTRAIN_CHECK(std::isfinite(r.grad_norm), "step {}: gradient norm is {}: training diverged",
                  r.step, r.grad_norm);
  r.lr = schedule_.at(step_);
  if (zero_) {
    zero_->step(r.lr, clip_factor(r.grad_norm, t.grad_clip));
    // The step's collectives: reduce-scatters, and the gathers waited for in it.
    const zero::ZeroStepTiming& timing = zero_->last_step();
    r.comm_ms = timing.comm_seconds * 1e3;
    r.exposed_comm_ms = timing.exposed_seconds * 1e3;
    r.comm_bytes = timing.bytes;
  } else {
    optimizer_->step(r.lr, clip_factor(r.grad_norm, t.grad_clip));
  }
  ++step_;
  if (tp.active()) r.tp_comm_bytes = tp.comm->stats().total().bytes - tp_bytes;

  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto tokens = static_cast<double>(t.tokens_per_step());
  r.step_ms = seconds * 1e3;
  r.data_ms = data_seconds * 1e3;
  r.tokens_per_s = tokens / seconds;
  // Per rank: this rank's share of the FLOPs (tp ranks split each token's, a
  // pipeline stage runs 1 / pp of the layers as balanced) against its peak.
  r.mfu = config_.model.train_flops_per_token(seq) * tokens /
          static_cast<double>(options_.dp_size * tp.size() * config_.parallel.pp) / seconds /
          peak_flops_;
  return r;
}

double Trainer::pipeline_micro_batches(float grad_scale, StepRecord& r) {
  const int64_t m = loader_->micro_batches_per_step();
  pp_batches_.resize(static_cast<size_t>(m));
  std::vector<pipeline::MicroBatchRef> refs;
  for (MicroBatch& batch : pp_batches_) {
    batch = loader_->next();
    refs.push_back({batch.inputs.data(), batch.targets.data()});
  }
  const double loss = pipeline_->run(refs, grad_scale);
  if (tied_) {
    // The first stage's embedding and the last stage's output layer are one
    // parameter: both get the sum of their gradients, so both updates agree.
    Parameter& embedding = model_->params()[0];
    tied_->all_reduce(embedding.grad.data<float>(), embedding.spec.numel(), CommDType::f32,
                      ReduceOp::sum);
  }
  const pipeline::StepTiming& timing = pipeline_->last_timing();
  r.pp_busy_ms = timing.busy_seconds * 1e3;
  r.pp_wait_ms = timing.wait_seconds * 1e3;
  r.pp_schedule_ms = timing.total_seconds * 1e3;
  r.pp_bubble = timing.busy_seconds > 0
                    ? (timing.total_seconds - timing.busy_seconds) / timing.busy_seconds
                    : 0.0;
  r.pp_bubble_theory = pipeline::theoretical_bubble(pipeline_->shape());
  r.pp_in_flight = static_cast<int64_t>(timing.peak_in_flight);
  return loss;
}

double Trainer::evaluate() {
  MESHTRAIN_CHECK(val_set_ != nullptr, "evaluate: no validation data (data.val)");
  // Always the same leading windows, so successive values are comparable.
  double loss_sum = 0;
  int64_t tokens = 0;
  std::vector<MicroBatch> batches;  // pipeline: all of them, then one pass
  for (int64_t k = 0; k < val_set_->num_micro_batches(); ++k) {
    val_set_->read(k, val_batch_);
    tokens += val_batch_.rows * val_batch_.seq_len;
    if (pipeline_) {
      // The stages agreed on one message size: the training micro-batch's.
      MESHTRAIN_CHECK(val_batch_.rows == pipeline_->micro_batch_rows(),
                      "evaluate: validation micro-batch of {} rows; the pipeline runs {}",
                      val_batch_.rows, pipeline_->micro_batch_rows());
      batches.push_back(val_batch_);
      continue;
    }
    loss_sum += model_->forward_loss(val_batch_.inputs.data(), val_batch_.targets.data(),
                                     val_batch_.rows, val_batch_.seq_len);
  }
  if (pipeline_) {
    std::vector<pipeline::MicroBatchRef> refs;
    for (const MicroBatch& b : batches) refs.push_back({b.inputs.data(), b.targets.data()});
    loss_sum = sum_over_ranks(options_.mesh->pp(), pipeline_->evaluate(refs));
  }
  Communicator* dp = ddp_ ? &ddp_->dp() : zero_ ? &zero_->dp() : nullptr;
  if (dp != nullptr) {
    loss_sum = sum_over_ranks(*dp, loss_sum);
    tokens = static_cast<int64_t>(sum_over_ranks(*dp, static_cast<double>(tokens)));
  }
  if (zero_) zero_->quiesce();  // stage 3: frees what the evaluation gathered
  return loss_sum / static_cast<double>(tokens);
}

std::string Trainer::save_checkpoint() {
  std::string dir = (fs::path(config_.train.out_dir) / step_dir_name(step_)).string();
  TrainState state;
  state.step = step_;
  state.optimizer_step = zero_ ? zero_->step_count() : optimizer_->step_count();
  state.sampler = loader_->position();
  state.seed = config_.train.seed;
  const TensorParallel& tp = model_->tensor_parallel();
  if (pipeline_) {
    // The stages gathered to pp rank 0 (of every dp rank; the tp ranks each
    // gather their slices), which writes the single-rank files: checkpoints
    // do not depend on the layout.
    // With ZeRO each stage's shards are gathered to its dp rank 0 first.
    Communicator& pp = options_.mesh->pp();
    const bool stage_writer = !zero_ || zero_->dp().rank() == 0;
    auto gather = [&](const Tensor& t, zero::ShardedDataParallel::State which) {
      if (!zero_) {
        return pipeline::gather_stages(pp, *model_, pipeline_->shape(), pp_split_, t.data<float>(),
                                       0);
      }
      std::vector<float> local(stage_writer ? static_cast<size_t>(model_->num_params()) : 0);
      zero_->gather_full(which, 0, stage_writer ? local.data() : nullptr);
      if (!stage_writer) return local;
      return pipeline::gather_stages(pp, *model_, pipeline_->shape(), pp_split_, local.data(), 0);
    };
    using State = zero::ShardedDataParallel::State;
    std::vector<float> master = gather(zero_ ? Tensor() : model_->flat_master(), State::master);
    std::vector<float> exp_avg = gather(zero_ ? Tensor() : optimizer_->exp_avg(), State::exp_avg);
    std::vector<float> exp_avg_sq =
        gather(zero_ ? Tensor() : optimizer_->exp_avg_sq(), State::exp_avg_sq);
    if (!stage_writer || pp.rank() != 0) return dir;
    auto tensor = [&](const std::vector<float>& values) {
      Tensor t({static_cast<int64_t>(values.size())}, DType::f32, MemCategory::workspace, tracker_);
      std::copy(values.begin(), values.end(), t.data<float>());
      return t;
    };
    const CheckpointTensors local{tensor(master), tensor(exp_avg), tensor(exp_avg_sq)};
    if (tp.active()) {
      save_tensor_parallel_checkpoint(dir, local, state);
    } else if (options_.mesh->coord().dp == 0) {
      meshtrain::save_checkpoint(dir, full_layout(config_.model), local, state, config_);
    }
    return dir;
  }
  if (!zero_) {
    const CheckpointTensors local{model_->flat_master(), optimizer_->exp_avg(),
                                  optimizer_->exp_avg_sq()};
    if (tp.active()) {
      save_tensor_parallel_checkpoint(dir, local, state);
    } else {
      meshtrain::save_checkpoint(dir, model_->params(), local, state, config_);
    }
    return dir;
  }
  // The shards gathered to rank 0, which writes the same files as a flat run.
  const bool writer = zero_->dp().rank() == 0;
  CheckpointTensors whole = workspace_state(writer ? model_->num_params() : 0, tracker_);
  using State = zero::ShardedDataParallel::State;
  for (auto [which, tensor] : {std::pair{State::master, &whole.master},
                               {State::exp_avg, &whole.exp_avg},
                               {State::exp_avg_sq, &whole.exp_avg_sq}}) {
    zero_->gather_full(which, 0, writer ? tensor->data<float>() : nullptr);
  }
  if (!writer) return dir;
  if (tp.active()) {
    save_tensor_parallel_checkpoint(dir, whole, state);
  } else {
    meshtrain::save_checkpoint(dir, model_->params(), whole, state, config_);
  }
  return dir;
}

// The tp group (one dp coordinate) assembles the whole tensors from its
// slices; world rank 0 writes them: the same files whatever tp.
std::vector<TensorSplit> Trainer::tp_local_splits() const {
  if (config_.parallel.pp == 1) return model_->param_splits();
  // A pipeline stage's checkpoint paths work on the whole model's layout.
  const TensorParallel& tp = model_->tensor_parallel();
  std::vector<TensorSplit> splits;
  for (const ParamSpec& spec : build_param_specs(config_.model, tp.rank(), tp.size())) {
    splits.push_back(spec.split);
  }
  return splits;
}

void Trainer::save_tensor_parallel_checkpoint(const std::string& dir, const CheckpointTensors& local,
                                              const TrainState& state) {
  const std::vector<TensorSplit> splits = tp_local_splits();
  CheckpointTensors whole = workspace_state(full_flat_numel(splits), tracker_);
  const TensorParallel& tp = model_->tensor_parallel();
  gather_tp_flat(tp, splits, local.master.data<float>(), whole.master.data<float>());
  gather_tp_flat(tp, splits, local.exp_avg.data<float>(), whole.exp_avg.data<float>());
  gather_tp_flat(tp, splits, local.exp_avg_sq.data<float>(), whole.exp_avg_sq.data<float>());
  if (options_.mesh->rank() == 0) {
    meshtrain::save_checkpoint(dir, full_layout(config_.model), whole, state, config_);
  }
}

void Trainer::log_step(const StepRecord& r) {
  nlohmann::json record{{"step", r.step},
                             {"loss", number(r.loss)},
                             {"lr", r.lr},
                             {"grad_norm", number(r.grad_norm)},
                             {"tokens_per_s", r.tokens_per_s},
                             {"mfu", r.mfu},
                             {"step_ms", r.step_ms},
                             {"data_ms", r.data_ms},
                             {"comm_ms", r.comm_ms},
                             {"exposed_comm_ms", r.exposed_comm_ms},
                             {"comm_bytes", r.comm_bytes},
                             {"tp_comm_bytes", r.tp_comm_bytes}};
  if (pipeline_) {
    record["pp_busy_ms"] = r.pp_busy_ms;
    record["pp_wait_ms"] = r.pp_wait_ms;
    record["pp_schedule_ms"] = r.pp_schedule_ms;
    record["pp_bubble"] = r.pp_bubble;
    record["pp_bubble_theory"] = r.pp_bubble_theory;
    record["pp_in_flight"] = r.pp_in_flight;
  }
  metrics_ << record.dump() << '\n';
  metrics_.flush();
  const TrainSettings& t = config_.train;
  if (options_.console && (r.step % t.log_interval == 0 || r.step == 1 || r.step == t.steps)) {
    fmt::print("step {:>5}/{} | loss {:.4f} | lr {:.3e} | grad_norm {:.3f} | {:.0f} tok/s | "
               "MFU {:.1f}% | {:.1f} ms{}\n",
               r.step, t.steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.mfu * 100, r.step_ms,
               ddp_ || zero_
                   ? fmt::format(" | comm {:.1f} ms, {:.1f} exposed", r.comm_ms, r.exposed_comm_ms)
                   : "");
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
    if (val_set_ && t.eval_interval > 0 && (step_ % t.eval_interval == 0 || last)) {
      log_eval(evaluate());
    }
    bool periodic = t.checkpoint_interval > 0 && step_ % t.checkpoint_interval == 0;
    // Replicas are identical: rank 0 writes for all (with ZeRO after a
    // gather every rank takes part in).
    // The same with tensor parallelism (the tp group assembles the slices)
    // and pipelines (the stages are gathered to pp rank 0).
    const bool writer = options_.mesh == nullptr || options_.mesh->rank() == 0 || zero_ ||
                        model_->tensor_parallel().active() ||
                        (pipeline_ && options_.mesh->coord().dp == 0);
    if (writer && t.checkpoint_interval >= 0 && (last || periodic)) {
      std::string dir = save_checkpoint();
      if (options_.console) fmt::print("checkpoint: {}\n", dir);
    }
  }
  log_memory("end");
  return records;
}

}  // namespace meshtrain
