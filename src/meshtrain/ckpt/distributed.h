// PLACEHOLDER (replaced by the ckpt branch): the API the trainer compiles against.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>
#include "meshtrain/parallel/layout/shard_map.h"
#include "meshtrain/tensor/memory_tracker.h"
namespace meshtrain::dist_ckpt {
struct SaveOptions { int rank = 0, world = 1; int64_t buffer_bytes = 64 << 20; bool async = false; int keep_last = 0; double commit_timeout_s = 600; MemoryTracker* tracker = nullptr; };
class CheckpointSaver {
 public:
  CheckpointSaver(std::string out_dir, SaveOptions options);
  ~CheckpointSaver();
  std::string save(int64_t step, const layout::ShardMap& map, layout::StateAccess& state, const nlohmann::json& layout_json, const nlohmann::json& meta);
  void wait();
  bool pending() const;
};
struct Manifest { nlohmann::json layout, meta; };
Manifest read_manifest(const std::string& dir);
bool is_sharded_checkpoint(const std::string& dir);
void verify_checkpoint(const std::string& dir, int64_t buffer_bytes = 64 << 20);
void load_checkpoint(const std::string& dir, const layout::ShardMap& map, layout::StateAccess& state, int64_t buffer_bytes = 64 << 20, bool verify = true);
void read_global_tensor(const Manifest& manifest, const std::string& dir, const std::string& name, layout::StateKind kind, float* out);
struct ResumeChoice { std::string dir; std::vector<std::string> notes; };
std::optional<ResumeChoice> find_resume_checkpoint(const std::string& out_dir);
std::string describe_checkpoint(const std::string& dir, bool verify);
bool is_legacy_checkpoint(const std::string& dir);
void convert_legacy_checkpoint(const std::string& old_dir, const std::string& new_dir);
}
