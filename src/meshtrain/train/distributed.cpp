#include "meshtrain/train/distributed.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

void check_same_config_on_all_ranks(const TrainConfig& config, Communicator& world) {
  TrainConfig shared = config;
  shared.train.threads = 0;
  auto mine = static_cast<int64_t>(fnv1a(config_to_json(shared)));
  std::vector<int64_t> all(static_cast<size_t>(world.size()));
  world.all_gather(&mine, all.data(), 1, CommDType::i64);
  for (size_t r = 0; r < all.size(); ++r) {
    MESHTRAIN_CHECK(all[r] == all[0],
                    "config: rank {} was given a different configuration from rank 0 "
                    "(every rank must run the same config and overrides)",
                    r);
  }
}

void check_parallel_layout(const ParallelSettings& parallel, const DeviceMesh& mesh) {
  MESHTRAIN_CHECK(mesh.layout().tp() == parallel.tp && mesh.layout().pp() == parallel.pp &&
                      mesh.layout().cp() == parallel.cp,
                  "parallel: the mesh ({}) does not match parallel.tp = {}, parallel.pp = {}, "
                  "parallel.cp = {}",
                  mesh.layout().describe(), parallel.tp, parallel.pp, parallel.cp);
}

OutDirLocks hold_out_dir(const std::string& out_dir, Communicator* world, bool under_launch) {
  const bool root = world == nullptr || world->rank() == 0;
  OutDirLocks locks;
  int64_t kind = -1;  // rank 0's error kind; -1: out_dir is this job's
  std::string message, warning;
  if (root) {
    try {
      locks = lock_out_dir(out_dir, under_launch, &warning);
    } catch (const Error& e) {
      kind = static_cast<int64_t>(e.kind());
      message = e.what();
    } catch (const std::exception& e) {
      kind = static_cast<int64_t>(ErrorKind::io);
      message = e.what();
    }
  }
  if (world != nullptr) {
    world->broadcast(&kind, 1, CommDType::i64, 0);
    message = broadcast_string(*world, message, 0);
  }
  if (kind >= 0) throw Error(message, static_cast<ErrorKind>(kind));
  if (!warning.empty()) std::fprintf(stderr, "%s\n", warning.c_str());
  if (!root) locks.ranks = join_out_dir(out_dir);
  return locks;
}

zero::ZeroOptions zero_options(const TrainConfig& config) {
  const ParallelSettings& p = config.parallel;
  zero::ZeroOptions o;
  o.stage = p.zero;
  o.prefetch = p.prefetch;
  o.reshard_after_forward = p.reshard_after_forward;
  o.max_inflight_reduces = p.max_inflight_reduces;
  o.offload.tier = zero::parse_offload_tier(p.offload);
  o.offload.budget_bytes = static_cast<size_t>(p.offload_budget_mb * 1024.0 * 1024.0);
  if (o.offload.tier == zero::OffloadTier::disk) {
    o.offload.directory = p.offload_dir.empty()
                              ? (std::filesystem::path(config.train.out_dir) / "offload").string()
                              : p.offload_dir;
    std::filesystem::create_directories(o.offload.directory);
    // The run's own prefix (FNV-1a of its out_dir), so that a restart removes
    // what a killed attempt left and nothing of another run sharing the directory.
    const std::string run = std::filesystem::absolute(config.train.out_dir).lexically_normal().string();
    uint32_t hash = 2166136261u;
    for (unsigned char c : run) hash = (hash ^ c) * 16777619u;
    o.offload.file_prefix = fmt::format("meshtrain-offload-{:08x}-", hash);
  }
  return o;
}

std::string describe_zero(const zero::ShardedDataParallel& zero) {
  const zero::ZeroOptions& o = zero.options();
  std::string text = fmt::format("ZeRO stage {}: {} flat parameters over dp {} (padding {} elements)",
                                 o.stage, zero.layout().flats.size(), zero.layout().dp,
                                 zero.layout().padding());
  if (o.stage == 3) {
    text += fmt::format(", prefetch {}, reshard after forward {}", o.prefetch ? "on" : "off",
                        o.reshard_after_forward ? "on" : "off");
  }
  if (o.offload.tier != zero::OffloadTier::none) {
    text += fmt::format(", {} offloaded to {}",
                        zero.params_offloaded() ? "parameters and optimizer state"
                                                : "optimizer state",
                        zero::offload_tier_name(o.offload.tier));
    if (o.offload.budget_bytes > 0) {
      text += fmt::format(" (resident budget {})", format_bytes(o.offload.budget_bytes));
    }
  }
  return text;
}

std::string broadcast_string(Communicator& comm, const std::string& text, int root) {
  int64_t size = static_cast<int64_t>(text.size());
  comm.broadcast(&size, 1, CommDType::i64, root);
  // Bytes travel as 32-bit words.
  std::vector<int32_t> words(static_cast<size_t>((size + 3) / 4), 0);
  if (words.empty()) return {};  // (memcpy from or to an empty vector's null data is undefined)
  if (comm.rank() == root) std::memcpy(words.data(), text.data(), text.size());
  comm.broadcast(words.data(), static_cast<int64_t>(words.size()), CommDType::i32, root);
  return std::string(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(size));
}

double sum_over_ranks(Communicator& comm, double value) {
  comm.all_reduce(&value, 1, CommDType::f64, ReduceOp::sum);
  return value;
}

std::vector<MoeLayerRecord> moe_step_records(const Model& model, DataParallel& data_parallel) {
  Communicator* dp_group = data_parallel.group();
  std::vector<MoeLayerRecord> out;
  for (const MoeLayerStats& st : model.moe_stats()) {
    std::vector<int64_t> tokens = st.tokens;
    tokens.push_back(st.dropped);
    double sums[3] = {st.aux, st.z, static_cast<double>(st.micro_batches)};
    if (dp_group != nullptr) {
      dp_group->all_reduce(tokens.data(), static_cast<int64_t>(tokens.size()), CommDType::i64,
                           ReduceOp::sum);
      dp_group->all_reduce(sums, 3, CommDType::f64, ReduceOp::sum);
    }
    MoeLayerRecord r;
    r.layer = st.layer;
    r.dropped = tokens.back();
    tokens.pop_back();
    r.tokens_min = *std::min_element(tokens.begin(), tokens.end());
    r.tokens_max = *std::max_element(tokens.begin(), tokens.end());
    r.tokens_mean = static_cast<double>(std::accumulate(tokens.begin(), tokens.end(), int64_t{0})) /
                    static_cast<double>(tokens.size());
    r.imbalance = r.tokens_mean > 0 ? static_cast<double>(r.tokens_max) / r.tokens_mean : 0;
    const double micro_batches = std::max(1.0, sums[2]);
    r.aux = sums[0] / micro_batches;
    r.z = sums[1] / micro_batches;
    r.tokens = std::move(tokens);
    if (const std::optional<size_t> i = model.selection_bias_param(st.layer)) {
      const std::vector<float> bias = data_parallel.parameter_values(*i);
      r.bias_min = *std::min_element(bias.begin(), bias.end());
      r.bias_max = *std::max_element(bias.begin(), bias.end());
    }
    out.push_back(std::move(r));
  }
  return out;
}

void update_moe_balancing(const Model& model, DataParallel& data_parallel,
                          const std::vector<MoeLayerRecord>& records) {
  for (const MoeLayerRecord& r : records) {
    if (const std::optional<size_t> i = model.selection_bias_param(r.layer)) {
      data_parallel.add_to_parameter(*i, model.selection_bias_change(r.tokens));
    }
  }
}

MemorySnapshot max_over_ranks(Communicator& comm, const MemorySnapshot& mine) {
  // One all-reduce: live by category, peak by category, then the two totals.
  std::vector<int64_t> values;
  for (size_t v : mine.live) values.push_back(static_cast<int64_t>(v));
  for (size_t v : mine.peak) values.push_back(static_cast<int64_t>(v));
  values.push_back(static_cast<int64_t>(mine.live_total));
  values.push_back(static_cast<int64_t>(mine.peak_total));
  comm.all_reduce(values.data(), static_cast<int64_t>(values.size()), CommDType::i64,
                  ReduceOp::max);
  MemorySnapshot out;
  for (size_t c = 0; c < kMemCategories; ++c) {
    out.live[c] = static_cast<size_t>(values[c]);
    out.peak[c] = static_cast<size_t>(values[kMemCategories + c]);
  }
  out.live_total = static_cast<size_t>(values[2 * kMemCategories]);
  out.peak_total = static_cast<size_t>(values[2 * kMemCategories + 1]);
  return out;
}

std::string metrics_file_name(int rank) {
  return rank == 0 ? "metrics.jsonl" : fmt::format("metrics.rank{}.jsonl", rank);
}

}  // namespace meshtrain
