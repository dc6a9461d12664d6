// Loading with resharding: each destination piece's global runs intersected
// with the runs of every overlapping source shard, read through one bounded
// buffer (neighbouring runs coalesced into one read) and written through
// StateAccess at the destination's local offsets.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>

#include "meshtrain/ckpt/dist_internal.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/util/error.h"

namespace meshtrain::dist_ckpt {
namespace {

using detail::join;
using layout::Region;
using layout::StateKind;

// Bytes between two runs of one file that one read may skip over rather than
// issue a second read.
constexpr uint64_t kMaxGapBytes = 64 << 10;
constexpr int64_t kGlobalReadBuffer = 16 << 20;

struct Run {
  int64_t region_offset, global_offset, count;
};

std::vector<Run> runs_of(const Shape& shape, const Region& region) {
  std::vector<Run> runs;
  layout::for_each_global_run(shape, region, [&](int64_t r, int64_t g, int64_t n) {
    runs.push_back(Run{r, g, n});
  });
  return runs;
}

// A quick filter: boxes over different views (a fused tensor's blocks) are
// compared by their runs only.
bool boxes_overlap(const Region& a, const Region& b) {
  if (a.view != b.view) return true;
  for (size_t d = 0; d < a.offset.size(); ++d) {
    if (a.offset[d] >= b.offset[d] + b.extent[d] || b.offset[d] >= a.offset[d] + a.extent[d]) {
      return false;
    }
  }
  return true;
}

// dst <- src elements: region offsets (elements) in the destination piece and the source shard.
struct Copy {
  const ManifestShard* shard;
  int64_t dst, src, count;
  uint64_t byte = 0;  // of the first element in the source file's data section
};

// Both run lists ascend in global offset (a box's row-major order is the
// tensor's): one merge pass.
void intersect(const std::vector<Run>& dst, const std::vector<Run>& src, const ManifestShard* shard,
               std::vector<Copy>& out) {
  size_t i = 0, j = 0;
  while (i < dst.size() && j < src.size()) {
    const Run& a = dst[i];
    const Run& b = src[j];
    const int64_t begin = std::max(a.global_offset, b.global_offset);
    const int64_t end = std::min(a.global_offset + a.count, b.global_offset + b.count);
    if (begin < end) {
      out.push_back(Copy{shard, a.region_offset + (begin - a.global_offset),
                         b.region_offset + (begin - b.global_offset), end - begin});
    }
    if (a.global_offset + a.count <= b.global_offset + b.count) {
      ++i;
    } else {
      ++j;
    }
  }
}

// The files one load reads from, opened (header validated). At most
// kMaxOpenFiles stay open (a checkpoint of thousands of ranks loaded into one
// would otherwise exhaust file descriptors).
class SourceFiles {
 public:
  // verify: each file's presence and size checked before its header is read.
  SourceFiles(const std::string& dir, const Manifest& manifest, bool verify, uint64_t& counter)
      : bytes_read(counter), dir_(dir), manifest_(manifest), verify_(verify) {}

  // The reader of the shard's file; the shard's key checked against the header.
  const SafetensorsReader& reader(const ManifestShard& shard) {
    auto it = open_.find(shard.file);
    if (it == open_.end()) {
      if (verify_) detail::check_file_present(dir_, *manifest_.find_file(shard.file));
      if (open_.size() >= kMaxOpenFiles) {
        auto oldest = std::min_element(
            open_.begin(), open_.end(),
            [](const auto& a, const auto& b) { return a.second.last_use < b.second.last_use; });
        open_.erase(oldest);
      }
      it = open_
               .emplace(shard.file,
                        Open{std::make_unique<SafetensorsReader>(join(dir_, shard.file)), 0})
               .first;
      bytes_read += it->second.reader->data_start();
    }
    it->second.last_use = ++uses_;
    const SafetensorsReader& r = *it->second.reader;
    if (checked_.insert(&shard).second) {
      const StTensorInfo& info = r.info(shard.key);
      // 4-aligned: a verified load's chunks of the data section hold whole floats.
      MESHTRAIN_CHECK(info.dtype == StDType::F32 && info.shape == Shape{shard.region.numel()} &&
                          info.begin % 4 == 0,
                      "{}: tensor '{}' is {} {} at byte {}, the manifest says F32 [{}]", r.path(),
                      shard.key, st_dtype_name(info.dtype), shape_str(info.shape), info.begin,
                      shard.region.numel());
    }
    return r;
  }

  uint64_t& bytes_read;  // headers and data

 private:
  static constexpr size_t kMaxOpenFiles = 64;
  struct Open {
    std::unique_ptr<SafetensorsReader> reader;
    uint64_t last_use = 0;
  };
  const std::string& dir_;
  const Manifest& manifest_;
  bool verify_;
  std::map<std::string, Open> open_;
  std::set<const ManifestShard*> checked_;
  uint64_t uses_ = 0;
};

// Throws unless the copies tile [0, numel) of the destination piece exactly.
void check_tiling(std::vector<Copy>& copies, int64_t numel, const std::string& tensor,
                  StateKind kind, const Region& region, const std::string& manifest_path) {
  std::sort(copies.begin(), copies.end(),
            [](const Copy& a, const Copy& b) { return a.dst < b.dst; });
  int64_t covered = 0;
  auto where = [&] {
    return fmt::format("tensor '{}' {}: this rank's region (offset {}, extent {}, flat [{}, {}))",
                       tensor, layout::state_kind_name(kind), shape_str(region.offset),
                       shape_str(region.extent), region.flat_begin, region.flat_end);
  };
  for (const Copy& c : copies) {
    MESHTRAIN_CHECK(c.dst >= covered, "{}: elements [{}, {}) are covered twice by the shards of {}",
                    where(), c.dst, covered, manifest_path);
    MESHTRAIN_CHECK(c.dst == covered, "{}: elements [{}, {}) are not covered by any shard of {}",
                    where(), covered, c.dst, manifest_path);
    covered = c.dst + c.count;
  }
  MESHTRAIN_CHECK(covered == numel, "{}: elements [{}, {}) are not covered by any shard of {}",
                  where(), covered, numel, manifest_path);
}

// Reads the copies' source bytes through `buffer` and writes them into the piece.
void read_copies(std::vector<Copy>& copies, const layout::ShardPiece& piece, StateKind kind,
                 SourceFiles& files, const Tensor& buffer, layout::StateAccess& state) {
  const int64_t capacity = buffer.numel();
  std::vector<Copy> split;
  for (const Copy& c : copies) {
    const uint64_t begin = files.reader(*c.shard).info(c.shard->key).begin;
    for (int64_t done = 0; done < c.count; done += capacity) {
      Copy part{c.shard, c.dst + done, c.src + done, std::min(capacity, c.count - done)};
      part.byte = begin + static_cast<uint64_t>(part.src) * 4;
      split.push_back(part);
    }
  }
  std::sort(split.begin(), split.end(), [](const Copy& a, const Copy& b) {
    return a.shard->file != b.shard->file ? a.shard->file < b.shard->file : a.byte < b.byte;
  });
  float* buf = buffer.data<float>();
  for (size_t i = 0; i < split.size();) {
    const uint64_t begin = split[i].byte;
    uint64_t end = begin + static_cast<uint64_t>(split[i].count) * 4;
    size_t j = i + 1;
    for (; j < split.size() && split[j].shard->file == split[i].shard->file; ++j) {
      const uint64_t next_end = split[j].byte + static_cast<uint64_t>(split[j].count) * 4;
      if (split[j].byte < end || split[j].byte - end > kMaxGapBytes ||
          next_end - begin > buffer.bytes()) {
        break;
      }
      end = next_end;
    }
    files.reader(*split[i].shard).read_data(begin, buf, static_cast<size_t>(end - begin));
    files.bytes_read += end - begin;
    for (size_t k = i; k < j; ++k) {
      state.write(kind, piece.local_offset + split[k].dst, split[k].count,
                  buf + (split[k].byte - begin) / 4);
    }
    i = j;
  }
}

// A verified load's writes: elements of one piece's state, from a file offset.
struct Delivery {
  StateKind kind;
  int64_t local_offset, count;
  uint64_t byte;  // in the file
};

// Reads the whole file once, hashing it, and writes the deliveries from the
// chunks as they pass; Error (corrupt) after the last chunk on a mismatch.
void stream_deliveries(const std::string& dir, const ManifestFile& file, uint64_t data_start,
                       std::vector<Delivery>& deliveries, const Tensor& buffer,
                       layout::StateAccess& state, uint64_t& bytes_read) {
  std::sort(deliveries.begin(), deliveries.end(),
            [](const Delivery& a, const Delivery& b) { return a.byte < b.byte; });
  auto end_of = [](const Delivery& d) { return d.byte + static_cast<uint64_t>(d.count) * 4; };
  size_t next = 0;  // deliveries before it are complete
  detail::stream_file(dir, file, buffer, data_start,
                      [&](uint64_t at, const char* bytes, uint64_t n) {
    for (size_t j = next; j < deliveries.size() && deliveries[j].byte < at + n; ++j) {
      const Delivery& d = deliveries[j];
      const uint64_t begin = std::max(d.byte, at), end = std::min(end_of(d), at + n);
      if (begin >= end) continue;
      state.write(d.kind, d.local_offset + static_cast<int64_t>((begin - d.byte) / 4),
                  static_cast<int64_t>((end - begin) / 4),
                  reinterpret_cast<const float*>(bytes + (begin - at)));
    }
    while (next < deliveries.size() && end_of(deliveries[next]) <= at + n) ++next;
  }, &bytes_read);
}

void load_states(const Manifest& manifest, const std::string& dir, const layout::ShardMap& map,
                 layout::StateAccess& state, std::span<const StateKind> kinds,
                 int64_t buffer_bytes, bool verify, MemoryTracker& tracker, uint64_t& bytes_read,
                 const Allocator& staging) {
  map.validate();
  const std::string manifest_path = join(dir, kManifestFile);
  std::map<std::string, const ManifestTensor*> by_name;
  for (const ManifestTensor& t : manifest.tensors) by_name.emplace(t.name, &t);
  uint64_t largest = 0;
  for (const ManifestFile& f : manifest.files) largest = std::max(largest, f.bytes);
  const Tensor buffer = detail::file_buffer(buffer_bytes, largest, tracker, staging);
  SourceFiles files(dir, manifest, verify, bytes_read);
  std::map<const ManifestShard*, std::vector<Run>> source_runs;
  struct FileDeliveries {
    uint64_t data_start = 0;
    std::vector<Delivery> list;
  };
  std::map<std::string, FileDeliveries> deliveries;  // verify: per file
  std::vector<Copy> copies;
  for (const layout::ShardPiece& piece : map.pieces) {
    const layout::GlobalTensor& t = map.tensors[piece.tensor];
    auto it = by_name.find(t.name);
    MESHTRAIN_CHECK(it != by_name.end(), "tensor '{}': not in {} ({} tensors)", t.name,
                    manifest_path, manifest.tensors.size());
    const ManifestTensor& saved = *it->second;
    MESHTRAIN_CHECK(saved.shape == t.shape, "tensor '{}': shape {} in {}, {} in this layout",
                    t.name, shape_str(saved.shape), manifest_path, shape_str(t.shape));
    const std::vector<Run> dst_runs = runs_of(t.shape, piece.region);
    for (StateKind kind : kinds) {
      if (!t.states.has(kind)) continue;  // frozen: no moments to fill
      MESHTRAIN_CHECK(saved.states.has(kind),
                      "tensor '{}': this layout has its {}, {} holds only {} (saved frozen)",
                      t.name, layout::state_kind_name(kind), manifest_path,
                      layout::state_set_str(saved.states));
      copies.clear();
      for (const ManifestShard& shard : saved.shards) {
        if (shard.state != kind || !boxes_overlap(shard.region, piece.region)) continue;
        auto [runs, added] = source_runs.try_emplace(&shard);
        if (added) runs->second = runs_of(saved.shape, shard.region);
        intersect(dst_runs, runs->second, &shard, copies);
      }
      check_tiling(copies, piece.region.numel(), t.name, kind, piece.region, manifest_path);
      if (!verify) {
        read_copies(copies, piece, kind, files, buffer, state);
        continue;
      }
      for (const Copy& c : copies) {
        const SafetensorsReader& r = files.reader(*c.shard);
        FileDeliveries& file = deliveries[c.shard->file];
        file.data_start = r.data_start();
        file.list.push_back(Delivery{
            kind, piece.local_offset + c.dst, c.count,
            r.data_start() + r.info(c.shard->key).begin + static_cast<uint64_t>(c.src) * 4});
      }
    }
  }
  // Each file this rank needs read once, start to end: checksummed as its
  // bytes go into the state.
  for (auto& [name, file] : deliveries) {
    stream_deliveries(dir, *manifest.find_file(name), file.data_start, file.list, buffer, state,
                      bytes_read);
  }
}

constexpr StateKind kAllStates[] = {StateKind::master, StateKind::exp_avg, StateKind::exp_avg_sq};

// Writes one state of a whole-tensor map straight into the caller's array.
class GlobalOut : public layout::StateAccess {
 public:
  GlobalOut(StateKind kind, float* out) : kind_(kind), out_(out) {}
  void read(StateKind, int64_t, int64_t, float*) override {
    fail("internal: read_global_tensor only writes");
  }
  void write(StateKind kind, int64_t local_offset, int64_t count, const float* in) override {
    MESHTRAIN_CHECK(kind == kind_, "internal: read_global_tensor got state {}",
                    layout::state_kind_name(kind));
    std::copy(in, in + count, out_ + local_offset);
  }

 private:
  StateKind kind_;
  float* out_;
};

}  // namespace

void load_checkpoint(const std::string& dir, const layout::ShardMap& map,
                     layout::StateAccess& state, int64_t buffer_bytes, bool verify,
                     MemoryTracker* tracker, uint64_t* bytes_read, const Allocator& staging) {
  const Manifest manifest = read_manifest(dir);
  MemoryTracker own;
  uint64_t local = 0;
  load_states(manifest, dir, map, state, kAllStates, buffer_bytes, verify,
              tracker != nullptr ? *tracker : own, bytes_read != nullptr ? *bytes_read : local,
              staging);
}

void read_global_tensor(const Manifest& manifest, const std::string& dir, const std::string& name,
                        layout::StateKind kind, float* out) {
  const ManifestTensor* t = manifest.find_tensor(name);
  MESHTRAIN_CHECK(t != nullptr, "tensor '{}': not in {}", name, join(dir, kManifestFile));
  MESHTRAIN_CHECK(t->states.has(kind), "tensor '{}': {} holds only its {} (saved frozen), no {}",
                  name, join(dir, kManifestFile), layout::state_set_str(t->states),
                  layout::state_kind_name(kind));
  layout::ShardMap map;
  map.tensors.push_back(layout::GlobalTensor{t->name, t->shape, t->states});
  map.pieces.push_back(layout::ShardPiece{0, layout::whole_region(t->shape), 0, 0});
  map.local_numel = shape_numel(t->shape);
  GlobalOut access(kind, out);
  MemoryTracker tracker;
  const StateKind kinds[] = {kind};
  uint64_t bytes_read = 0;
  load_states(manifest, dir, map, access, kinds, kGlobalReadBuffer, false, tracker, bytes_read,
              host_allocator());
}

}  // namespace meshtrain::dist_ckpt
