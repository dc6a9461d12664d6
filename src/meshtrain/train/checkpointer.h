// One checkpointer whatever the layout: it reads the rank's shard map (the
// model's, narrowed by the data parallelism) once and saves / loads through
// it, so every layout writes the same sharded format (ckpt/distributed.h) and
// loads any other (resharding by slice overlap).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/model/model.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data_parallel.h"

namespace meshtrain {

class Checkpointer {
 public:
  // model, dp, mesh (may be null: one process) and tracker must outlive this.
  Checkpointer(const TrainConfig& config, DeviceMesh* mesh, Model& model, DataParallel& dp,
               MemoryTracker& tracker);
  ~Checkpointer();

  const layout::ShardMap& shard_map() const { return map_; }
  // Seconds the last save blocked the caller (async: the staging copy) and
  // the last load took.
  double last_save_seconds() const { return save_seconds_; }
  double last_load_seconds() const { return load_seconds_; }
  // Every rank: writes out_dir/step_<state.step> (ckpt.async: returns once
  // this rank's state is staged). Returns the directory.
  std::string save(const TrainState& state);
  // Waits for a pending asynchronous save (every rank; then it is committed).
  void wait();
  // Every rank: fills this rank's weights and optimizer state from `dir`, a
  // sharded checkpoint of any layout or one of the whole-tensor format; each
  // file's checksum is computed as it is read (Error kind corrupt on a
  // mismatch, the state then partly overwritten).
  void load(const std::string& dir);
  // Collective: loads the first of `candidates` (newest first) that every
  // rank reads without a corrupt or unreadable file, every rank agreeing;
  // `skipped` gets one line per candidate passed over (the first failing
  // rank's error). Returns its directory, or "" when none loads: the state
  // is then partly overwritten and must be reinitialised (reset_state). Other
  // errors end every rank.
  std::string load_newest(const std::vector<std::string>& candidates,
                          std::vector<std::string>& skipped);
  // Zeroes the optimizer state (after a load that failed; init_weights then
  // writes the master weights).
  void reset_optimizer_state();
  // Bytes the last load read from checkpoint files (all its attempts).
  uint64_t last_load_bytes() const { return load_bytes_; }
  // Every rank: only this rank's master weights from `dir` (train.init_from):
  // a sharded checkpoint of any layout (its moments dropped), or a whole model
  // load_model_dir reads (Hugging Face, whole-tensor checkpoint), built on this
  // rank and cut to its pieces. The optimizer state is left as it is (fresh).
  void load_weights(const std::string& dir, Backend& backend);
  // One state (master weights, a moment) as whole tensors in the flat
  // single-rank layout (registry order of the whole model), on every rank,
  // assembled from the owners' pieces. Collective.
  std::vector<float> gather(layout::StateKind kind);

 private:
  nlohmann::json layout_json() const;
  // load() without DataParallel::finish_load (a collective under ZeRO).
  void load_files(const std::string& dir);
  void load_legacy(const std::string& dir);

  const TrainConfig& config_;
  DeviceMesh* mesh_;
  Model& model_;
  DataParallel& dp_;
  MemoryTracker& tracker_;
  layout::ShardMap map_;
  std::unique_ptr<dist_ckpt::CheckpointSaver> saver_;
  double save_seconds_ = 0, load_seconds_ = 0;
  uint64_t load_bytes_ = 0;
};

}  // namespace meshtrain
