// The manifest and done files (JSON both ways, validated), file checksums,
// verification and the `ckpt inspect` text.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/dist_internal.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/unique_fd.h"

namespace meshtrain::dist_ckpt {
namespace detail {
namespace {

namespace fs = std::filesystem;
using layout::Region;
using layout::StateKind;

constexpr const char* kChecksumField = "manifest_xxh3";

// Field access with errors naming the file and the object (`where`).
struct Fields {
  const std::string& path;

  const json& at(const json& object, const std::string& where, const char* key) const {
    MESHTRAIN_CHECK(object.is_object() && object.contains(key), "{}: {}: missing field '{}'", path,
                    where, key);
    return object.at(key);
  }
  int64_t integer(const json& object, const std::string& where, const char* key) const {
    const json& v = at(object, where, key);
    MESHTRAIN_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0,
                    "{}: {}: field '{}' must be a non-negative integer, not {}", path, where, key,
                    v.dump());
    return v.get<int64_t>();
  }
  std::string string(const json& object, const std::string& where, const char* key) const {
    const json& v = at(object, where, key);
    MESHTRAIN_CHECK(v.is_string(), "{}: {}: field '{}' must be a string", path, where, key);
    return v.get<std::string>();
  }
  // ints() whose product (a shape's or a box's element count) fits in int64:
  // the layout code multiplies them unchecked.
  std::vector<int64_t> dims(const json& object, const std::string& where, const char* key) const {
    std::vector<int64_t> out = ints(object, where, key);
    int64_t n = 1;
    for (int64_t d : out) {
      MESHTRAIN_CHECK(!__builtin_mul_overflow(n, d, &n),
                      "{}: {}: field '{}' {} has more elements than int64 holds", path, where, key,
                      shape_str(out));
    }
    return out;
  }
  std::vector<int64_t> ints(const json& object, const std::string& where, const char* key) const {
    const json& v = at(object, where, key);
    std::vector<int64_t> out;
    MESHTRAIN_CHECK(v.is_array(), "{}: {}: field '{}' must be an array", path, where, key);
    for (const json& x : v) {
      MESHTRAIN_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0,
                      "{}: {}: field '{}' must hold non-negative integers, not {}", path, where,
                      key, v.dump());
      out.push_back(x.get<int64_t>());
    }
    return out;
  }
  uint64_t hex(const json& object, const std::string& where, const char* key) const {
    const std::string text = string(object, where, key);
    MESHTRAIN_CHECK(text.size() == 16 && text.find_first_not_of("0123456789abcdef") == text.npos,
                    "{}: {}: field '{}' must be 16 hex digits, not '{}'", path, where, key, text);
    return std::stoull(text, nullptr, 16);
  }
  const json& array(const json& object, const std::string& where, const char* key) const {
    const json& v = at(object, where, key);
    MESHTRAIN_CHECK(v.is_array(), "{}: {}: field '{}' must be an array", path, where, key);
    return v;
  }
};

json shard_json(const ManifestShard& s) {
  json j{{"file", s.file},
         {"key", s.key},
         {"state", layout::state_kind_name(s.state)},
         {"offset", s.region.offset},
         {"extent", s.region.extent},
         {"flat_begin", s.region.flat_begin},
         {"flat_end", s.region.flat_end}};
  // A region over a reshaping of the tensor (a fused tensor's blocks).
  if (!s.region.view.empty()) j["view"] = s.region.view;
  return j;
}

ManifestShard shard_from_json(const Fields& f, const json& v, const std::string& where) {
  ManifestShard s;
  s.file = f.string(v, where, "file");
  s.key = f.string(v, where, "key");
  s.state = parse_state(f.string(v, where, "state"), f.path + ": " + where);
  s.region.offset = f.ints(v, where, "offset");
  s.region.extent = f.dims(v, where, "extent");
  if (v.is_object() && v.contains("view")) s.region.view = f.dims(v, where, "view");
  for (size_t d = 0; d < std::min(s.region.offset.size(), s.region.extent.size()); ++d) {
    int64_t end = 0;
    MESHTRAIN_CHECK(!__builtin_add_overflow(s.region.offset[d], s.region.extent[d], &end),
                    "{}: {}: offset + extent of dimension {} overflows int64", f.path, where, d);
  }
  s.region.flat_begin = f.integer(v, where, "flat_begin");
  s.region.flat_end = f.integer(v, where, "flat_end");
  return s;
}

json states_json(layout::StateSet states) {
  json out = json::array();
  for (size_t k = 0; k < layout::kStateKinds; ++k) {
    const auto kind = static_cast<StateKind>(k);
    if (states.has(kind)) out.push_back(layout::state_kind_name(kind));
  }
  return out;
}

// A tensor's "states" list; absent (checkpoints written before the list
// existed, every tensor with all three): all three.
layout::StateSet states_from_json(const Fields& f, const json& v, const std::string& where) {
  if (!v.is_object() || !v.contains("states")) return layout::StateSet{};
  const json& list = f.array(v, where, "states");
  layout::StateSet states{0};
  for (const json& name : list) {
    MESHTRAIN_CHECK(name.is_string(), "{}: {}: field 'states' must hold state names", f.path,
                    where);
    const StateKind kind = parse_state(name.get<std::string>(), f.path + ": " + where);
    MESHTRAIN_CHECK(!states.has(kind), "{}: {}: state '{}' is listed twice", f.path, where,
                    layout::state_kind_name(kind));
    states.bits |= static_cast<uint8_t>(1u << static_cast<int>(kind));
  }
  MESHTRAIN_CHECK(states.has(StateKind::master), "{}: {}: field 'states' lacks 'master'", f.path,
                  where);
  return states;
}

uint64_t checksum_of(const json& manifest_without_checksum) {
  const std::string text = manifest_without_checksum.dump();
  return XXH3_64bits(text.data(), text.size());
}

// A file name inside the checkpoint directory, never a path out of it.
bool plain_file_name(const std::string& name) {
  return !name.empty() && name.find('/') == name.npos && name != "." && name != "..";
}

// Throws unless the shards of every tensor are valid regions that hold, per
// state, as many elements as the tensor (the load checks the exact tiling).
void check_tensors(const std::vector<ManifestTensor>& tensors, const std::string& path) {
  layout::ShardMap map;
  for (const ManifestTensor& t : tensors) {
    const size_t index = map.tensors.size();
    map.tensors.push_back(layout::GlobalTensor{t.name, t.shape, t.states});
    for (const ManifestShard& s : t.shards) {
      map.pieces.push_back(layout::ShardPiece{index, s.region, 0, 0});
      map.local_numel = std::max(map.local_numel, s.region.box_numel());
    }
  }
  try {
    map.validate();
  } catch (const Error& e) {
    fail("{}: {}", path, e.what());
  }
  for (const ManifestTensor& t : tensors) {
    int64_t held[layout::kStateKinds] = {};
    for (const ManifestShard& s : t.shards) held[static_cast<size_t>(s.state)] += s.region.numel();
    for (size_t k = 0; k < layout::kStateKinds; ++k) {
      const auto kind = static_cast<StateKind>(k);
      const int64_t want = t.states.has(kind) ? shape_numel(t.shape) : 0;
      MESHTRAIN_CHECK(held[k] == want,
                      "{}: tensor '{}' {}: the shards hold {} elements, {}", path, t.name,
                      layout::state_kind_name(kind), held[k],
                      want > 0 ? fmt::format("the tensor has {}", want)
                               : fmt::format("its states are {}", layout::state_set_str(t.states)));
    }
  }
}

}  // namespace

std::string step_name(int64_t step) { return fmt::format("step_{}", step); }
std::string rank_file_name(int rank) { return fmt::format("rank_{}.safetensors", rank); }
std::string done_file_name(int rank) { return fmt::format("rank_{}.done.json", rank); }
std::string join(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

StateKind parse_state(const std::string& name, const std::string& where) {
  for (size_t k = 0; k < layout::kStateKinds; ++k) {
    if (name == layout::state_kind_name(static_cast<StateKind>(k)))
      return static_cast<StateKind>(k);
  }
  fail("{}: unknown state '{}' (expected master, exp_avg or exp_avg_sq)", where, name);
}

json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK(in.good(), "{}: missing or unreadable", path);
  std::stringstream text;
  text << in.rdbuf();
  MESHTRAIN_CHECK(!in.bad(), "{}: read failed", path);
  try {
    return json::parse(text.str());
  } catch (const json::exception& e) {
    fail_as(ErrorKind::corrupt, "{}: corrupt: not valid JSON: {}", path, e.what());
  }
}

void write_json_atomic(const std::string& path, const json& value) {
  write_file_atomic(path, value.dump(1) + "\n");
}

uint64_t file_buffer_bytes(int64_t limit, uint64_t needed) {
  MESHTRAIN_CHECK(limit >= 4, "checkpoint buffer of {} bytes: at least 4 bytes are needed", limit);
  uint64_t bytes = std::max<uint64_t>(4, std::min<uint64_t>(limit, needed));
  // Whole 4096-byte units when it can: full buffers then write around the page cache.
  if (bytes >= 4096) bytes -= bytes % 4096;
  return bytes / 4 * 4;
}

Tensor file_buffer(int64_t limit, uint64_t needed, MemoryTracker& tracker,
                   const Allocator& allocator) {
  return Tensor({static_cast<int64_t>(file_buffer_bytes(limit, needed) / 4)}, DType::f32,
                MemCategory::workspace, tracker, allocator);
}

void stream_file(const std::string& dir, const ManifestFile& file, const Tensor& buffer,
                 uint64_t data_start, const ChunkFn& on_chunk, uint64_t* bytes_read) {
  const std::string path = join(dir, file.name);
  const UniqueFd file_fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  const int fd = file_fd.get();
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, fd >= 0 || errno != ENOENT,
                     "{}: missing (listed in the manifest)", path);
  MESHTRAIN_CHECK_AS(ErrorKind::io, fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  MESHTRAIN_CHECK_AS(ErrorKind::io, ::fstat(fd, &st) == 0, "{}: cannot stat: {}", path,
                     std::strerror(errno));
  check_file_size(path, static_cast<uint64_t>(st.st_size), file.bytes);
  const uint64_t size = file.bytes;
  XXH3_state_t* state = XXH3_createState();
  MESHTRAIN_CHECK(state != nullptr, "{}: cannot start a checksum", path);
  struct Freer {
    XXH3_state_t* s;
    ~Freer() { XXH3_freeState(s); }
  } freer{state};
  XXH3_64bits_reset(state);
  char* const buf = static_cast<char*>(buffer.raw());
  for (uint64_t done = 0; done < size;) {
    // Chunks never straddle data_start: from there on they hold whole floats.
    const uint64_t limit = done < data_start ? std::min(data_start, size) : size;
    const uint64_t end = std::min<uint64_t>(limit, done + buffer.bytes());
    for (uint64_t at = done; at < end;) {
      const ssize_t n = ::pread(fd, buf + (at - done), end - at, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      MESHTRAIN_CHECK_AS(ErrorKind::io, n >= 0, "{}: read failed: {}", path, std::strerror(errno));
      MESHTRAIN_CHECK_AS(ErrorKind::corrupt, n > 0, "{}: truncated while reading at byte {}",
                         path, at);
      at += static_cast<uint64_t>(n);
      if (bytes_read != nullptr) *bytes_read += static_cast<uint64_t>(n);
    }
    XXH3_64bits_update(state, buf, end - done);
    if (on_chunk) on_chunk(done, buf, end - done);
    done = end;
  }
  const uint64_t got = XXH3_64bits_digest(state);
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, got == file.xxh3,
                     "{}: corrupt: XXH3-64 {}, the manifest says {}", path, hex64(got),
                     hex64(file.xxh3));
}

void check_file_size(const std::string& path, uint64_t size, uint64_t listed) {
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, size >= listed,
                     "{}: truncated: {} bytes, the manifest says {}", path, size, listed);
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, size == listed,
                     "{}: corrupt: {} bytes, the manifest says {}", path, size, listed);
}

void check_file_present(const std::string& dir, const ManifestFile& file) {
  const std::string path = join(dir, file.name);
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, !ec, "{}: missing (listed in the manifest)", path);
  check_file_size(path, size, file.bytes);
}

void verify_file(const std::string& dir, const ManifestFile& file, const Tensor& buffer) {
  stream_file(dir, file, buffer, 0, nullptr);
}

json rank_record_json(const RankRecord& record, int64_t step, const std::string& save_id) {
  json pieces = json::array();
  for (const PieceRecord& p : record.pieces) {
    json piece = shard_json(p.shard);
    piece["tensor"] = p.tensor;
    piece["shape"] = p.shape;
    pieces.push_back(std::move(piece));
  }
  json held = json::array();
  for (const layout::GlobalTensor& t : record.held)
    held.push_back({{"name", t.name}, {"shape", t.shape}, {"states", states_json(t.states)}});
  return {{"format", std::string(kFormat) + "-done"},
          {"step", step},
          {"save_id", save_id},
          {"rank", record.rank},
          {"world", record.world},
          {"file", record.file},
          {"bytes", record.bytes},
          {"xxh3", hex64(record.xxh3)},
          {"held", std::move(held)},
          {"pieces", std::move(pieces)}};
}

RankRecord rank_record_from_json(const json& value, const std::string& path) {
  const Fields f{path};
  RankRecord r;
  r.rank = static_cast<int>(f.integer(value, "done file", "rank"));
  r.world = static_cast<int>(f.integer(value, "done file", "world"));
  r.file = f.string(value, "done file", "file");
  MESHTRAIN_CHECK(r.file.empty() || plain_file_name(r.file), "{}: file '{}' is not a plain name",
                  path, r.file);
  r.bytes = static_cast<uint64_t>(f.integer(value, "done file", "bytes"));
  r.xxh3 = f.hex(value, "done file", "xxh3");
  const json& held = f.array(value, "done file", "held");
  for (size_t i = 0; i < held.size(); ++i) {
    const std::string where = fmt::format("held[{}]", i);
    r.held.push_back(layout::GlobalTensor{f.string(held[i], where, "name"),
                                          f.ints(held[i], where, "shape"),
                                          states_from_json(f, held[i], where)});
  }
  const json& pieces = f.array(value, "done file", "pieces");
  for (size_t i = 0; i < pieces.size(); ++i) {
    const std::string where = fmt::format("pieces[{}]", i);
    PieceRecord p;
    p.tensor = f.string(pieces[i], where, "tensor");
    p.shape = f.ints(pieces[i], where, "shape");
    p.shard = shard_from_json(f, pieces[i], where);
    r.pieces.push_back(std::move(p));
  }
  return r;
}

ManifestFile carry_file(const std::string& path, const std::string& dir) {
  const std::string bytes = read_file_text(path);
  ManifestFile file;
  file.name = fs::path(path).filename().string();
  MESHTRAIN_CHECK(plain_file_name(file.name) && file.name != kManifestFile &&
                      !file.name.starts_with("rank_"),
                  "checkpoint: carried file '{}' would clash with the checkpoint's own files", path);
  write_file_atomic(join(dir, file.name), bytes);
  file.bytes = bytes.size();
  file.xxh3 = XXH3_64bits(bytes.data(), bytes.size());
  return file;
}

json manifest_json(int64_t step, const std::string& save_id, const json& layout_json,
                   const json& meta, const std::vector<RankRecord>& ranks,
                   const std::vector<ManifestFile>& carried) {
  std::vector<ManifestTensor> tensors;
  std::map<std::string, size_t> index;
  auto tensor_of = [&](const std::string& name, const Shape& shape, int rank) -> ManifestTensor& {
    auto [it, added] = index.emplace(name, tensors.size());
    if (added) tensors.push_back(ManifestTensor{name, shape, "F32", {}, {}});
    ManifestTensor& t = tensors[it->second];
    MESHTRAIN_CHECK(t.shape == shape,
                    "checkpoint step_{}: tensor '{}' has shape {} on rank {}, {} "
                    "on a lower rank",
                    step, name, shape_str(shape), rank, shape_str(t.shape));
    return t;
  };
  json files = json::array();
  std::set<std::string> seen;
  for (const RankRecord& r : ranks) {
    for (const layout::GlobalTensor& held : r.held) {
      ManifestTensor& t = tensor_of(held.name, held.shape, r.rank);
      MESHTRAIN_CHECK(seen.insert(held.name).second || t.states == held.states,
                      "checkpoint step_{}: tensor '{}' has states {} on rank {}, {} on a lower rank",
                      step, held.name, layout::state_set_str(held.states), r.rank,
                      layout::state_set_str(t.states));
      t.states = held.states;
    }
    for (const PieceRecord& p : r.pieces)
      tensor_of(p.tensor, p.shape, r.rank).shards.push_back(p.shard);
    if (!r.file.empty())
      files.push_back({{"name", r.file}, {"bytes", r.bytes}, {"xxh3", hex64(r.xxh3)}});
  }
  for (const ManifestFile& f : carried) {
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh3", hex64(f.xxh3)}});
  }
  // A tensor some rank holds but no rank owns (replica 0) would be lost: refuse.
  check_tensors(tensors, fmt::format("checkpoint step_{}", step));
  json tensor_list = json::array();
  for (const ManifestTensor& t : tensors) {
    json shards = json::array();
    for (const ManifestShard& s : t.shards) shards.push_back(shard_json(s));
    tensor_list.push_back({{"name", t.name},
                           {"shape", t.shape},
                           {"dtype", t.dtype},
                           {"states", states_json(t.states)},
                           {"shards", std::move(shards)}});
  }
  json manifest = {{"format", kFormat},
                   {"version", kVersion},
                   {"step", step},
                   {"world", ranks.size()},
                   {"save_id", save_id},
                   {"layout", layout_json},
                   {"meta", meta},
                   {"tensors", std::move(tensor_list)},
                   {"files", std::move(files)}};
  manifest[kChecksumField] = hex64(checksum_of(manifest));
  return manifest;
}

void write_manifest(const std::string& dir, const json& manifest) {
  write_json_atomic(join(dir, kManifestFile), manifest);
}

}  // namespace detail

using detail::Fields;
using detail::json;

const ManifestTensor* Manifest::find_tensor(const std::string& name) const {
  for (const ManifestTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const ManifestFile* Manifest::find_file(const std::string& name) const {
  for (const ManifestFile& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

int64_t Manifest::total_bytes() const {
  int64_t n = 0;
  for (const ManifestFile& f : files) n += static_cast<int64_t>(f.bytes);
  return n;
}

Manifest read_manifest(const std::string& dir) {
  const std::string path = detail::join(dir, kManifestFile);
  json value = detail::read_json_file(path);
  const Fields f{path};
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, value.is_object(), "{}: corrupt: not a JSON object", path);
  const std::string stored = f.string(value, "manifest", detail::kChecksumField);
  value.erase(detail::kChecksumField);
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, stored == detail::hex64(detail::checksum_of(value)),
                     "{}: corrupt: its contents do not match its checksum {}", path, stored);
  MESHTRAIN_CHECK(f.string(value, "manifest", "format") == detail::kFormat,
                  "{}: field 'format' is not '{}'", path, detail::kFormat);
  Manifest m;
  m.version = static_cast<int>(f.integer(value, "manifest", "version"));
  MESHTRAIN_CHECK(m.version == detail::kVersion, "{}: version {} is not supported (expected {})",
                  path, m.version, detail::kVersion);
  m.step = f.integer(value, "manifest", "step");
  m.world = static_cast<int>(f.integer(value, "manifest", "world"));
  m.save_id = f.string(value, "manifest", "save_id");
  m.layout = f.at(value, "manifest", "layout");
  m.meta = f.at(value, "manifest", "meta");

  const json& files = f.array(value, "manifest", "files");
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = fmt::format("files[{}]", i);
    ManifestFile file;
    file.name = f.string(files[i], where, "name");
    MESHTRAIN_CHECK(detail::plain_file_name(file.name), "{}: {}: '{}' is not a plain file name",
                    path, where, file.name);
    MESHTRAIN_CHECK(m.find_file(file.name) == nullptr, "{}: file '{}' is listed twice", path,
                    file.name);
    file.bytes = static_cast<uint64_t>(f.integer(files[i], where, "bytes"));
    file.xxh3 = f.hex(files[i], where, "xxh3");
    m.files.push_back(std::move(file));
  }
  const json& tensors = f.array(value, "manifest", "tensors");
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    ManifestTensor t;
    t.name = f.string(tensors[i], fmt::format("tensors[{}]", i), "name");
    const std::string where = fmt::format("tensor '{}'", t.name);
    MESHTRAIN_CHECK(names.insert(t.name).second, "{}: tensor '{}' is listed twice", path, t.name);
    t.shape = f.dims(tensors[i], where, "shape");
    t.dtype = f.string(tensors[i], where, "dtype");
    t.states = detail::states_from_json(f, tensors[i], where);
    MESHTRAIN_CHECK(t.dtype == "F32", "{}: {}: dtype '{}' is not supported (expected F32)", path,
                    where, t.dtype);
    const json& shards = f.array(tensors[i], where, "shards");
    for (size_t j = 0; j < shards.size(); ++j) {
      ManifestShard s =
          detail::shard_from_json(f, shards[j], fmt::format("{} shards[{}]", where, j));
      MESHTRAIN_CHECK(m.find_file(s.file) != nullptr, "{}: {}: shard file '{}' is not in 'files'",
                      path, where, s.file);
      t.shards.push_back(std::move(s));
    }
    m.tensors.push_back(std::move(t));
  }
  detail::check_tensors(m.tensors, path);
  return m;
}

bool is_sharded_checkpoint(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(detail::join(dir, kManifestFile), ec);
}

void verify_checkpoint(const std::string& dir, int64_t buffer_bytes, MemoryTracker* tracker) {
  const Manifest m = read_manifest(dir);
  MemoryTracker own;
  uint64_t largest = 0;
  for (const ManifestFile& f : m.files) largest = std::max(largest, f.bytes);
  const Tensor buffer = detail::file_buffer(buffer_bytes, largest, tracker ? *tracker : own);
  for (const ManifestFile& f : m.files) detail::verify_file(dir, f, buffer);
}

std::string describe_checkpoint(const std::string& dir, bool verify, int* failed_files) {
  const Manifest m = read_manifest(dir);
  std::string out = fmt::format("checkpoint {}\n", dir);
  out += fmt::format("format {} v{}, step {}, world {}, save id {}\n", detail::kFormat, m.version,
                     m.step, m.world, m.save_id);
  out += fmt::format("layout: {}\nmeta: {}\n", m.layout.dump(), m.meta.dump());
  out += fmt::format("files ({}, {} bytes in all):\n", m.files.size(), m.total_bytes());
  MemoryTracker tracker;
  uint64_t largest = 0;
  for (const ManifestFile& f : m.files) largest = std::max(largest, f.bytes);
  const Tensor buffer = detail::file_buffer(int64_t{16} << 20, largest, tracker);
  int bad = 0;
  for (const ManifestFile& f : m.files) {
    out += fmt::format("  {}  {} bytes  xxh3 {}", f.name, f.bytes, detail::hex64(f.xxh3));
    if (verify) {
      try {
        detail::verify_file(dir, f, buffer);
        out += "  ok";
      } catch (const Error& e) {
        ++bad;
        out += fmt::format("  FAILED: {}", e.what());
      }
    }
    out += "\n";
  }
  out += fmt::format("tensors ({}):\n", m.tensors.size());
  for (const ManifestTensor& t : m.tensors) {
    out += fmt::format("  {} {} {}, {}; {} shards\n", t.name, shape_str(t.shape), t.dtype,
                       layout::state_set_str(t.states), t.shards.size());
    for (const ManifestShard& s : t.shards) {
      out += fmt::format("    {} {} '{}' {}offset {} extent {} flat [{}, {})\n",
                         layout::state_kind_name(s.state), s.file, s.key,
                         s.region.view.empty() ? "" : "view " + shape_str(s.region.view) + " ",
                         shape_str(s.region.offset), shape_str(s.region.extent),
                         s.region.flat_begin, s.region.flat_end);
    }
  }
  if (verify) {
    out += bad == 0 ? "verify: all files ok\n" : fmt::format("verify: {} file(s) FAILED\n", bad);
  }
  if (failed_files != nullptr) *failed_files = bad;
  return out;
}

}  // namespace meshtrain::dist_ckpt
