// Pieces shared by the distributed checkpoint's files (save, manifest,
// resharding load, legacy conversion). Not a public header.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::dist_ckpt::detail {

using json = nlohmann::json;

inline constexpr const char* kFormat = "meshtrain-dist-ckpt";
inline constexpr int kVersion = 1;
inline constexpr const char* kOpenFile = "open.json";
inline constexpr const char* kFailedFile = "failed.json";  // rank 0's error, for the others

std::string step_name(int64_t step);   // "step_12"
std::string rank_file_name(int rank);  // "rank_3.safetensors"
std::string done_file_name(int rank);  // "rank_3.done.json"
std::string join(const std::string& dir, const std::string& name);

std::string hex64(uint64_t value);  // 16 lowercase hex digits
layout::StateKind parse_state(const std::string& name, const std::string& where);

// Test-only fault hook: when MESHTRAIN_CKPT_FAULT is `point` or `point@step`
// (matching this step), the process kills itself with SIGKILL here.
void fault_point(const char* point, int64_t step);

void fsync_dir(const std::string& dir);
json read_json_file(const std::string& path);  // Error naming the file
void write_json_atomic(const std::string& path, const json& value);

// A tracked workspace buffer of whole floats for file data: min(limit, needed)
// bytes rounded down to a float, at least one float; Error when limit < 4.
Tensor file_buffer(int64_t limit, uint64_t needed, MemoryTracker& tracker,
                   const Allocator& allocator = host_allocator());
uint64_t file_buffer_bytes(int64_t limit, uint64_t needed);  // that buffer's size

// Streams the file through `buffer`: exists, size and XXH3-64 as the manifest
// says; Error "<path>: missing | truncated | corrupt ...".
void verify_file(const std::string& dir, const ManifestFile& file, const Tensor& buffer);
// The same pass, handing every chunk to on_chunk(file_offset, bytes, count)
// as it is read and hashed (chunks end at data_start, so the data section's
// chunks hold whole floats); the mismatch is found after the last chunk.
// Adds the bytes read to *bytes_read as it goes (when given).
using ChunkFn = std::function<void(uint64_t, const char*, uint64_t)>;
void stream_file(const std::string& dir, const ManifestFile& file, const Tensor& buffer,
                 uint64_t data_start, const ChunkFn& on_chunk, uint64_t* bytes_read = nullptr);
// Error (corrupt) "<path>: truncated | corrupt: N bytes, the manifest says M".
void check_file_size(const std::string& path, uint64_t size, uint64_t listed);
// The file exists at the size the manifest lists (a stat, nothing read);
// Error (corrupt) "<path>: missing | truncated | corrupt ...".
void check_file_present(const std::string& dir, const ManifestFile& file);

// Copies the small file `path` into `dir` under its file name (fsync'ed,
// atomic) and returns its manifest entry. Error (io) naming the file.
ManifestFile carry_file(const std::string& path, const std::string& dir);

// One saved piece, as a done file and the manifest list it.
struct PieceRecord {
  std::string tensor;
  Shape shape;
  ManifestShard shard;
};

// What one rank wrote: its file (empty name when it owns nothing) and pieces.
struct RankRecord {
  int rank = 0, world = 1;
  std::string file;
  uint64_t bytes = 0, xxh3 = 0;
  std::vector<layout::GlobalTensor> held;  // every tensor the rank holds any piece of
  std::vector<PieceRecord> pieces;         // the replica-0 pieces it wrote, per state
};

// Writes `dir`/rank_<rank>.safetensors with the replica-0 pieces of `map`,
// streaming from `state` through a buffer of at most buffer_bytes; or, when
// `staged` is given, straight from it (the owned elements in file order: state
// by state, pieces in map order). The buffer is `allocator`'s memory.
RankRecord write_rank_file(const std::string& dir, int rank, int64_t step,
                           const layout::ShardMap& map, layout::StateAccess& state,
                           int64_t buffer_bytes, MemoryTracker& tracker,
                           const float* staged = nullptr,
                           const Allocator& allocator = host_allocator());

json rank_record_json(const RankRecord& record, int64_t step, const std::string& save_id);
// Error naming `path` on anything malformed.
RankRecord rank_record_from_json(const json& value, const std::string& path);

// The manifest of the ranks' records (tensors in first-seen order, rank by
// rank), with its own checksum; written fsync'ed and atomically.
// `carried`: files copied in besides the rank files (SaveOptions::carried_files).
json manifest_json(int64_t step, const std::string& save_id, const json& layout_json,
                   const json& meta, const std::vector<RankRecord>& ranks,
                   const std::vector<ManifestFile>& carried = {});
void write_manifest(const std::string& dir, const json& manifest);

}  // namespace meshtrain::dist_ckpt::detail
