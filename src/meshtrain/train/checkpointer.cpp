#include "meshtrain/train/checkpointer.h"

#include "meshtrain/train/checkpoint.h"

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/lora_export.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t buffer_bytes(const TrainConfig& config) {
  return static_cast<int64_t>(config.ckpt.buffer_mb * 1024 * 1024);
}

// The pieces init_from fills: all but the LoRA adapters a base without them
// (an HF directory, a plain run's checkpoint) lacks; those keep their initial
// values (lora_B = 0: step 0 is the base model).
layout::ShardMap pieces_in_source(const layout::ShardMap& map,
                                  const std::function<bool(const std::string&)>& source_has) {
  layout::ShardMap out = map;
  std::erase_if(out.pieces, [&](const layout::ShardPiece& p) {
    const std::string& name = map.tensors[p.tensor].name;
    return is_lora_tensor(name) && !source_has(name);
  });
  return out;
}

}  // namespace

Checkpointer::Checkpointer(const TrainConfig& config, DeviceMesh* mesh, Model& model,
                           DataParallel& dp, MemoryTracker& tracker)
    : config_(config), mesh_(mesh), model_(model), dp_(dp), tracker_(tracker),
      map_(dp.shard_map(model.shard_map())) {
  map_.validate();
  dist_ckpt::SaveOptions options;
  options.rank = mesh != nullptr ? mesh->rank() : 0;
  options.world = mesh != nullptr ? mesh->world().size() : 1;
  options.buffer_bytes = buffer_bytes(config);
  options.async = config.ckpt.async;
  options.keep_last = static_cast<int>(config.ckpt.keep_last);
  options.tracker = &tracker;
  options.staging = &model.backend().staging_allocator();
  options.carried_files = run_tokenizer_files(config.data);
  saver_ = std::make_unique<dist_ckpt::CheckpointSaver>(config.train.out_dir, options);
}

Checkpointer::~Checkpointer() = default;

nlohmann::json Checkpointer::layout_json() const {
  const ParallelSettings& p = config_.parallel;
  const int world = mesh_ != nullptr ? mesh_->world().size() : 1;
  return {{"world", world},
          {"dp", world / (p.tp * p.pp * p.cp)},
          {"cp", p.cp},
          {"tp", p.tp},
          {"pp", p.pp},
          {"virtual_stages", p.virtual_stages},
          {"pp_split", p.pp_split},
          {"zero", p.zero},
          {"offload", p.offload}};
}

std::string Checkpointer::save(const TrainState& state) {
  trace::Span span("checkpoint", "checkpoint save", state.step);
  const auto start = std::chrono::steady_clock::now();
  dp_.quiesce();
  std::string dir = saver_->save(state.step, map_, dp_.state(), layout_json(),
                                 train_state_json(state, config_));
  // Synchronous: rank 0 has committed when everyone passes the barrier.
  if (!config_.ckpt.async && mesh_ != nullptr) mesh_->world().barrier();
  save_seconds_ = seconds_since(start);
  return dir;
}

void Checkpointer::wait() {
  saver_->wait();
  if (mesh_ != nullptr) mesh_->world().barrier();
}

void Checkpointer::load(const std::string& dir) {
  const auto start = std::chrono::steady_clock::now();
  load_files(dir);
  dp_.finish_load();
  load_seconds_ = seconds_since(start);
}

void Checkpointer::load_files(const std::string& dir) {
  dp_.quiesce();
  load_bytes_ = 0;
  if (dist_ckpt::is_sharded_checkpoint(dir)) {
    dist_ckpt::load_checkpoint(dir, map_, dp_.state(), buffer_bytes(config_), true, nullptr,
                               &load_bytes_, model_.backend().staging_allocator());
  } else {
    load_legacy(dir);
  }
}

std::string Checkpointer::load_newest(const std::vector<std::string>& candidates,
                                      std::vector<std::string>& skipped) {
  const auto start = std::chrono::steady_clock::now();
  Communicator* world = mesh_ != nullptr ? &mesh_->world() : nullptr;
  const int rank = world != nullptr ? world->rank() : 0;
  const int size = world != nullptr ? world->size() : 1;
  uint64_t bytes = 0;
  for (const std::string& dir : candidates) {
    // 0: loaded; 1: a corrupt or unreadable file (try the next); 2: any other error.
    int outcome = 0;
    std::string error;
    ErrorKind kind = ErrorKind::config;
    try {
      load_files(dir);  // finish_load (collective under ZeRO) once every rank has loaded
    } catch (const Error& e) {
      kind = e.kind();
      outcome = kind == ErrorKind::corrupt || kind == ErrorKind::io ? 1 : 2;
      error = e.what();
    }
    bytes += load_bytes_;
    // Every rank learns the worst outcome and the first failing rank's error.
    double worst = outcome, first = outcome > 0 ? size - rank : 0;
    if (world != nullptr) {
      world->all_reduce(&worst, 1, CommDType::f64, ReduceOp::max);
      world->all_reduce(&first, 1, CommDType::f64, ReduceOp::max);
    }
    if (worst == 0) {
      dp_.finish_load();
      load_bytes_ = bytes;
      load_seconds_ = seconds_since(start);
      return dir;
    }
    const int failed = size - static_cast<int>(first);
    if (world != nullptr) error = broadcast_string(*world, error, failed);
    MESHTRAIN_CHECK(worst == 1 || outcome == 2, "{}: rank {} could not load it: {}", dir, failed,
                    error);
    if (outcome == 2) throw Error(error, kind);
    skipped.push_back(fmt::format("{}: skipped: rank {}: {}", fs::path(dir).filename().string(),
                                  failed, error));
  }
  load_bytes_ = bytes;
  load_seconds_ = seconds_since(start);
  return "";
}

void Checkpointer::reset_optimizer_state() {
  dp_.quiesce();
  const std::vector<float> zeros(size_t{1} << 16, 0.0f);
  const auto chunk = static_cast<int64_t>(zeros.size());
  for (const layout::ShardPiece& p : map_.pieces) {
    const layout::GlobalTensor& t = map_.tensors[p.tensor];
    for (layout::StateKind kind : {layout::StateKind::exp_avg, layout::StateKind::exp_avg_sq}) {
      if (!t.states.has(kind)) continue;
      for (int64_t at = 0; at < p.region.numel(); at += chunk) {
        dp_.state().write(kind, p.local_offset + at, std::min(chunk, p.region.numel() - at),
                          zeros.data());
      }
    }
  }
}

void Checkpointer::load_weights(const std::string& dir, Backend& backend) {
  const auto start = std::chrono::steady_clock::now();
  dp_.quiesce();
  layout::StateAccess& masters = dp_.state();
  const layout::ShardMap weights = layout::master_weights_only(map_);
  const DirTensors tensors = dir_tensors(dir, tracker_, backend);
  std::set<std::string> names;
  for (const ParamSpec& spec : build_param_specs(tensors.config)) names.insert(spec.name);
  const layout::ShardMap map =
      pieces_in_source(weights, [&](const std::string& name) { return names.count(name) == 1; });
  if (dist_ckpt::is_sharded_checkpoint(dir)) {
    dist_ckpt::load_checkpoint(dir, map, masters, buffer_bytes(config_));
  } else {
    // One tensor at a time, read whole; each rank writes its regions of it.
    std::vector<float> piece;
    Tensor tensor;
    size_t loaded = static_cast<size_t>(-1);
    for (const layout::ShardPiece& p : map.pieces) {
      const layout::GlobalTensor& t = map.tensors[p.tensor];
      if (loaded != p.tensor) {
        tensor = Tensor();
        tensor = Tensor(t.shape, DType::f32, MemCategory::workspace, tracker_);
        ParamSpec spec;
        spec.name = t.name;
        spec.shape = spec.split.global_shape = t.shape;
        tensors.source(spec, tensor.data<float>());
        loaded = p.tensor;
      }
      piece.resize(static_cast<size_t>(p.region.numel()));
      layout::for_each_global_run(t.shape, p.region, [&](int64_t at, int64_t global, int64_t n) {
        std::copy_n(tensor.data<float>() + global, n, piece.data() + at);
      });
      masters.write(layout::StateKind::master, p.local_offset, p.region.numel(), piece.data());
    }
  }
  load_nf4_weights(model_, tensors.source);
  dp_.finish_load();
  load_seconds_ = seconds_since(start);
}

// The whole-tensor format: every tensor read whole (one at a time) and this
// rank's regions taken from it.
void Checkpointer::load_legacy(const std::string& dir) {
  constexpr const char* kFiles[layout::kStateKinds] = {"model.safetensors", "exp_avg.safetensors",
                                                       "exp_avg_sq.safetensors"};
  std::vector<float> piece;
  Tensor whole;
  for (size_t k = 0; k < layout::kStateKinds; ++k) {
    const auto kind = static_cast<layout::StateKind>(k);
    SafetensorsReader reader((fs::path(dir) / kFiles[k]).string());
    MESHTRAIN_CHECK(reader.tensors().size() == build_param_specs(config_.model).size(),
                    "{}: {} tensors, the model has {} parameters", reader.path(),
                    reader.tensors().size(), build_param_specs(config_.model).size());
    size_t loaded = static_cast<size_t>(-1);
    for (const layout::ShardPiece& p : map_.pieces) {
      const layout::GlobalTensor& t = map_.tensors[p.tensor];
      if (!t.states.has(kind)) continue;  // frozen: its zero moments are not state
      if (loaded != p.tensor) {
        whole = Tensor();
        whole = Tensor(t.shape, DType::f32, MemCategory::workspace, tracker_);
        reader.read(t.name, whole);
        loaded = p.tensor;
      }
      piece.resize(static_cast<size_t>(p.region.numel()));
      layout::for_each_global_run(t.shape, p.region, [&](int64_t at, int64_t global, int64_t n) {
        std::copy_n(whole.data<float>() + global, n, piece.data() + at);
      });
      dp_.state().write(kind, p.local_offset, p.region.numel(), piece.data());
    }
  }
}

std::vector<float> Checkpointer::gather(layout::StateKind kind) {
  dp_.quiesce();
  // Every element has exactly one writer (replica 0): each rank places its
  // owned pieces, zeros elsewhere, and a sum over the world assembles them exactly.
  std::map<std::string, int64_t> offsets;
  int64_t total = 0;
  for (const ParamSpec& spec : build_param_specs(config_.model)) {
    offsets[spec.name] = total;
    total += spec.numel();
  }
  std::vector<float> full(static_cast<size_t>(total), 0.0f), piece;
  for (const layout::ShardPiece& p : map_.pieces) {
    const layout::GlobalTensor& t = map_.tensors[p.tensor];
    if (p.replica != 0 || !t.states.has(kind)) continue;  // a frozen tensor's moments: zeros
    piece.resize(static_cast<size_t>(p.region.numel()));
    dp_.state().read(kind, p.local_offset, p.region.numel(), piece.data());
    const int64_t base = offsets.at(t.name);
    layout::for_each_global_run(t.shape, p.region, [&](int64_t at, int64_t global, int64_t n) {
      std::copy_n(piece.data() + at, n, full.data() + base + global);
    });
  }
  if (mesh_ != nullptr && mesh_->world().size() > 1) {
    mesh_->world().all_reduce(full.data(), total, CommDType::f32, ReduceOp::sum);
  }
  return full;
}

}  // namespace meshtrain
