// Today's whole-tensor step directories (train/checkpoint.h) as sharded
// checkpoints: the three safetensors files become one rank file of
// whole-tensor regions, streamed through the save's bounded buffer.
#include <algorithm>
#include <filesystem>

#include "meshtrain/ckpt/dist_internal.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/util/error.h"

namespace meshtrain::dist_ckpt {
namespace {

namespace fs = std::filesystem;
using detail::join;
using layout::StateKind;

constexpr const char* kTrainState = "train_state.json";
// Indexed by StateKind, as train/checkpoint.cpp writes them.
constexpr const char* kLegacyFiles[layout::kStateKinds] = {
    "model.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"};

// Reads the local state space of a whole-tensor map from the three files.
class LegacyState : public layout::StateAccess {
 public:
  LegacyState(const layout::ShardMap& map,
              const std::vector<std::unique_ptr<SafetensorsReader>>& files)
      : map_(map), files_(files) {}

  void read(StateKind kind, int64_t local_offset, int64_t count, float* out) override {
    const SafetensorsReader& file = *files_[static_cast<size_t>(kind)];
    while (count > 0) {
      // The last piece starting at or before local_offset (pieces ascend).
      auto it = std::upper_bound(
          map_.pieces.begin(), map_.pieces.end(), local_offset,
          [](int64_t off, const layout::ShardPiece& p) { return off < p.local_offset; });
      MESHTRAIN_CHECK(it != map_.pieces.begin(),
                      "internal: legacy offset {} before the first tensor", local_offset);
      const layout::ShardPiece& p = *std::prev(it);
      const int64_t within = local_offset - p.local_offset;
      const int64_t n = std::min(count, p.region.numel() - within);
      MESHTRAIN_CHECK(n > 0, "internal: legacy offset {} past the last tensor", local_offset);
      const StTensorInfo& info = file.info(map_.tensors[p.tensor].name);
      file.read_data(info.begin + static_cast<uint64_t>(within) * 4, out,
                     static_cast<size_t>(n) * 4);
      out += n;
      local_offset += n;
      count -= n;
    }
  }
  void write(StateKind, int64_t, int64_t, const float*) override {
    fail("internal: a legacy checkpoint is converted read-only");
  }

 private:
  const layout::ShardMap& map_;
  const std::vector<std::unique_ptr<SafetensorsReader>>& files_;
};

}  // namespace

bool is_legacy_checkpoint(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(join(dir, kTrainState), ec) &&
         fs::is_regular_file(join(dir, kLegacyFiles[0]), ec) && !is_sharded_checkpoint(dir);
}

void convert_legacy_checkpoint(const std::string& legacy_dir, const std::string& new_dir,
                               int64_t buffer_bytes, MemoryTracker* tracker) {
  MESHTRAIN_CHECK(is_legacy_checkpoint(legacy_dir),
                  "{}: not a whole-tensor checkpoint (needs {} and {}, no {})", legacy_dir,
                  kTrainState, kLegacyFiles[0], kManifestFile);
  std::error_code ec;
  MESHTRAIN_CHECK(!fs::exists(new_dir, ec), "{}: already exists; not overwriting", new_dir);
  const detail::json meta = detail::read_json_file(join(legacy_dir, kTrainState));
  MESHTRAIN_CHECK(meta.is_object(), "{}: not a JSON object", join(legacy_dir, kTrainState));

  std::vector<std::unique_ptr<SafetensorsReader>> files;
  for (const char* name : kLegacyFiles) {
    files.push_back(std::make_unique<SafetensorsReader>(join(legacy_dir, name)));
  }
  // The model file's tensors, in data order, define the map; the moments must match them.
  layout::ShardMap map;
  for (const StTensorInfo& t : files[0]->tensors()) {
    MESHTRAIN_CHECK(t.dtype == StDType::F32 && t.numel() > 0,
                    "{}: tensor '{}' is {} {}: only non-empty F32 tensors convert",
                    files[0]->path(), t.name, st_dtype_name(t.dtype), shape_str(t.shape));
    for (size_t k = 1; k < files.size(); ++k) {
      const StTensorInfo& m = files[k]->info(t.name);
      MESHTRAIN_CHECK(m.dtype == t.dtype && m.shape == t.shape,
                      "{}: tensor '{}' is {} {}, {} has {} {}", files[k]->path(), t.name,
                      st_dtype_name(m.dtype), shape_str(m.shape), kLegacyFiles[0],
                      st_dtype_name(t.dtype), shape_str(t.shape));
    }
    map.pieces.push_back(
        layout::ShardPiece{map.tensors.size(), layout::whole_region(t.shape), map.local_numel, 0});
    map.tensors.push_back(layout::GlobalTensor{t.name, t.shape, {}});
    map.local_numel += t.numel();
  }
  for (size_t k = 1; k < files.size(); ++k) {
    MESHTRAIN_CHECK(files[k]->tensors().size() == map.tensors.size(), "{}: {} tensors, {} has {}",
                    files[k]->path(), files[k]->tensors().size(), kLegacyFiles[0],
                    map.tensors.size());
  }

  const std::string tmp = new_dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  LegacyState state(map, files);
  MemoryTracker own;
  const int64_t step =
      meta.contains("step") && meta["step"].is_number_integer() ? meta["step"].get<int64_t>() : 0;
  const detail::RankRecord record = detail::write_rank_file(tmp, 0, step, map, state, buffer_bytes,
                                                            tracker != nullptr ? *tracker : own);
  const detail::json layout_json = {{"dp", 1},
                                    {"tp", 1},
                                    {"pp", 1},
                                    {"virtual_stages", 1},
                                    {"zero", 0},
                                    {"offload", false},
                                    {"converted_from", "whole-tensor"}};
  detail::write_manifest(tmp, detail::manifest_json(step, "converted-" + detail::hex64(record.xxh3),
                                                    layout_json, meta, {record}));
  detail::fsync_dir(tmp);
  fs::rename(tmp, new_dir);
  const fs::path parent = fs::absolute(new_dir).parent_path();
  detail::fsync_dir(parent.string());
}

}  // namespace meshtrain::dist_ckpt
