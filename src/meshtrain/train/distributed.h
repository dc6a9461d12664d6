// The multi-rank parts of the training loop, kept out of the loop itself.
#pragma once

#include <string>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/model/model.h"
#include "meshtrain/parallel/zero/sharded.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data_parallel.h"
#include "meshtrain/train/step.h"
#include "meshtrain/util/out_dir_lock.h"

namespace meshtrain {

// Throws Error on every rank when the ranks were given different
// configurations (a hash of the resolved config; train.threads may differ
// between nodes and is left out). Collective over `world`.
void check_same_config_on_all_ranks(const TrainConfig& config, Communicator& world);

// Checks the mesh against the config.
void check_parallel_layout(const ParallelSettings& parallel, const DeviceMesh& mesh);

// Takes out_dir for this job (util/out_dir_lock.h): rank 0 locks it and its
// verdict goes to every rank, so a refusal (Error busy, naming the holder)
// ends all ranks together with the same line; then every rank joins. Rank 0
// prints a warning where the file system has no locks. Collective over
// `world` (null: a single process).
OutDirLocks hold_out_dir(const std::string& out_dir, Communicator* world, bool under_launch);

// ZeRO's options from [parallel] (the disk tier's directory created).
zero::ZeroOptions zero_options(const TrainConfig& config);
// "ZeRO stage 3: 14 flat parameters (padding 9 elements), prefetch on, ..." for the console.
std::string describe_zero(const zero::ShardedDataParallel& zero);

// `text` from `root` on every member (blocking).
std::string broadcast_string(Communicator& comm, const std::string& text, int root);
// Sum of `value` over the group (blocking).
double sum_over_ranks(Communicator& comm, double value);
// The routing statistics of `model`'s MoE layers since its last
// reset_moe_stats, summed over the data-parallel group (none: this rank
// alone), with each selection bias's range as `data_parallel` holds it;
// empty for a dense model. Collective over the group.
std::vector<MoeLayerRecord> moe_step_records(const Model& model, DataParallel& data_parallel);
// DeepSeek-V3's balancing after an applied optimizer step: each MoE layer's
// selection bias moved by the step's loads (Model::selection_bias_change,
// added through `data_parallel`, whatever ZeRO stage holds it); a no-op
// without moe.bias_update_rate. The same on every dp rank.
void update_moe_balancing(const Model& model, DataParallel& data_parallel,
                          const std::vector<MoeLayerRecord>& records);

// Every category's live and peak bytes: the maximum over the group (blocking).
MemorySnapshot max_over_ranks(Communicator& comm, const MemorySnapshot& mine);

// Rank 0 writes metrics.jsonl (as a single-rank run does); rank R > 0 metrics.rank<R>.jsonl.
std::string metrics_file_name(int rank);

}  // namespace meshtrain
