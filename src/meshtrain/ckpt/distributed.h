// Distributed (sharded) checkpoints: every rank writes the training state it
// owns, in the layout it trains with; any other layout loads it back.
//
// A checkpoint is a directory <out_dir>/step_<N>/ holding
//   rank_<r>.safetensors  for each rank that owns anything: per StateKind and
//                         per replica-0 piece of the rank's ShardMap whose
//                         tensor has that state (GlobalTensor::states: a
//                         frozen tensor has no moments), a 1-D f32 tensor
//                         "<state>/<tensor name>#<k>" (k counts the rank's
//                         pieces of that tensor), in region order;
//   manifest.json         written last: format, version, the caller's layout
//                         and meta objects (opaque here), every global
//                         tensor with its states and shards (file, key,
//                         state, region),
//                         every file's size and XXH3-64, and a checksum of
//                         the manifest itself.
// <out_dir>/latest names the newest committed step directory.
//
// Commit protocol (through the filesystem only; no MPI calls here): rank 0
// removes leftover step_*.tmp directories, creates step_<N>.tmp with an
// open.json carrying a fresh save id; every rank waits for that, writes and
// fsyncs its file, then rank_<r>.done.json (size, checksum, pieces, save id).
// Rank 0 waits for all `world` done files, writes manifest.json, renames
// step_<N>.tmp to step_<N>, then rewrites `latest`, then applies keep_last.
// Every rank's save is complete when the manifest with its save id is
// committed. A crash at any instant leaves the previous checkpoint and
// `latest` valid. docs/distributed.md has the details.
//
// Memory: a sync save or a load holds at most `buffer_bytes` of file data
// (tracked as MemCategory::workspace), however large the state; an async save
// holds a staging copy of the rank's owned state (every state its tensors
// have) instead, and keeps it for the next save.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/parallel/layout/shard_map.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::dist_ckpt {

// The workspace a save takes on a rank that writes `owned_states` elements
// (ShardMap::owned_state_numel: its replica-0 pieces times the states their
// tensors have): a sync save's file buffer (min(buffer_bytes, its file's
// data), in whole 4096-byte units from 4 KiB; none when it writes nothing), or
// an async save's staging copy of them, kept for the next save.
uint64_t save_workspace_bytes(int64_t owned_states, int64_t buffer_bytes, bool async);

struct SaveOptions {
  int rank = 0, world = 1;
  int64_t buffer_bytes = 64 << 20;   // staging buffer for file data (sync save)
  bool async = false;                // copy the owned state at save(), write in the background
  int keep_last = 0;                 // committed checkpoints kept by rank 0; 0: keep all
  double commit_timeout_s = 600;     // how long any rank waits for the others
  MemoryTracker* tracker = nullptr;  // where file buffers are counted; null: a private one
  // The file buffer's and the async staging copy's memory (Backend::staging_allocator:
  // page-locked when the state is on a GPU); null: host_allocator().
  const Allocator* staging = nullptr;
  const Allocator& staging_memory() const { return staging != nullptr ? *staging : host_allocator(); }
  // Small files rank 0 copies into every checkpoint under their own names (the
  // run's tokenizer, so a moved checkpoint still has it), listed and
  // checksummed in the manifest's files like the rank files.
  std::vector<std::string> carried_files;
};

class CheckpointSaver {
 public:
  CheckpointSaver(std::string out_dir, SaveOptions options);
  ~CheckpointSaver();  // waits (errors logged, not thrown)
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Saves this rank's replica-0 pieces of every state; layout_json and meta
  // are written into the manifest (rank 0's copies). Waits for the previous
  // save first (and throws its Error). Sync: returns when the checkpoint is
  // committed (every rank). Async: returns once the owned state is copied; the
  // background thread writes from that copy. Returns out_dir/step_<N>.
  std::string save(int64_t step, const layout::ShardMap& map, layout::StateAccess& state,
                   const nlohmann::json& layout_json, const nlohmann::json& meta);
  // Waits for the background save; rethrows its Error (naming the file).
  void wait();
  bool pending() const;

 private:
  struct Job;
  std::string out_dir_;
  SaveOptions options_;
  std::unique_ptr<MemoryTracker> own_tracker_;
  std::unique_ptr<Job> job_;
  // Async: the staging copy, kept for the next save (no allocation, page
  // faults or zeroing at the step boundary after the first).
  Tensor staging_;
};

struct ManifestShard {
  std::string file, key;
  layout::StateKind state = layout::StateKind::master;
  layout::Region region;
};

struct ManifestTensor {
  std::string name;
  Shape shape;
  std::string dtype = "F32";
  std::vector<ManifestShard> shards;  // all states
  layout::StateSet states;            // those it has shards of (frozen: master only)
};

struct ManifestFile {
  std::string name;  // relative to the checkpoint directory
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;
};

struct Manifest {
  int version = 1;
  int64_t step = 0;
  int world = 1;
  std::string save_id;
  nlohmann::json layout, meta;
  std::vector<ManifestTensor> tensors;
  std::vector<ManifestFile> files;

  const ManifestTensor* find_tensor(const std::string& name) const;
  const ManifestFile* find_file(const std::string& name) const;
  int64_t total_bytes() const;
};

inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kLatestFile = "latest";

// Error naming the file/field on anything malformed, including a manifest
// whose own checksum does not match.
Manifest read_manifest(const std::string& dir);
bool is_sharded_checkpoint(const std::string& dir);  // has manifest.json
// Every file: exists, size, checksum; Error naming the file ("corrupt",
// "truncated", "missing").
void verify_checkpoint(const std::string& dir, int64_t buffer_bytes = 64 << 20,
                       MemoryTracker* tracker = nullptr);

// Fills every piece of `map` (replica 0 or not), each state its tensor has,
// from the overlapping shards of whatever layout wrote `dir`. With verify,
// each file it needs is read once, start to end, its XXH3-64 computed over
// the bytes as they go into `state`; a mismatch is an Error (corrupt) naming
// the file after the file's last byte, with `state` partly overwritten: the
// caller loads another checkpoint or reinitialises. Without verify, only the
// needed bytes are read. Error naming tensor and file when a region is not
// covered or a shape differs. `bytes_read` (when given) gets the bytes read
// from rank files added as they are read, a failed load's too. The read
// buffer is `staging`'s memory (Backend::staging_allocator when `state` is on a GPU).
void load_checkpoint(const std::string& dir, const layout::ShardMap& map,
                     layout::StateAccess& state, int64_t buffer_bytes = 64 << 20,
                     bool verify = true, MemoryTracker* tracker = nullptr,
                     uint64_t* bytes_read = nullptr,
                     const Allocator& staging = host_allocator());

// One whole global tensor of one state (numel of its shape f32 at `out`),
// assembled from the shards. Memory: that tensor plus a small buffer.
void read_global_tensor(const Manifest& manifest, const std::string& dir, const std::string& name,
                        layout::StateKind kind, float* out);

// --resume auto's candidates: the checkpoint out_dir/latest names, then the
// older committed step_* directories, newest first, each with a valid
// manifest, every rank file it lists present at its size (their checksums are
// the load's: load_checkpoint with verify reads each byte once) and its small
// carried files verified. `notes` says
// what was skipped and why, one line each. nullopt when none passes.
struct ResumeChoice {
  std::string dir;                     // the newest candidate
  std::vector<std::string> fallbacks;  // the older ones, newest first
  std::vector<std::string> notes;
};
std::optional<ResumeChoice> find_resume_checkpoint(const std::string& out_dir);

// `meshtrain ckpt inspect`: layout, meta, tensors (name, shape, shards), file
// sizes and, with verify, each file's checksum result; `failed_files` (when
// given) gets how many failed, so the caller can exit non-zero.
std::string describe_checkpoint(const std::string& dir, bool verify, int* failed_files = nullptr);

// Today's whole-tensor step directories (train/checkpoint.h: model.safetensors,
// exp_avg.safetensors, exp_avg_sq.safetensors, train_state.json).
bool is_legacy_checkpoint(const std::string& dir);
// Writes legacy_dir's state as a sharded checkpoint at new_dir (one rank file
// of whole-tensor regions; meta = train_state.json's object; layout
// {dp:1, tp:1, pp:1, ...}), streaming through buffer_bytes; new_dir appears
// complete or not at all. No `latest` is written.
void convert_legacy_checkpoint(const std::string& legacy_dir, const std::string& new_dir,
                               int64_t buffer_bytes = 64 << 20, MemoryTracker* tracker = nullptr);

}  // namespace meshtrain::dist_ckpt
