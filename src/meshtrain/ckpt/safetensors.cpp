#include "meshtrain/ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

using json = nlohmann::json;

// The reference implementation's limit; a larger header is a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
// Conversion scratch: bounded, however large the tensor.
constexpr size_t kChunkElements = 1u << 16;

StDType parse_st_dtype(std::string_view name, bool* known) {
  *known = true;
  if (name == "F64") return StDType::F64;
  if (name == "F32") return StDType::F32;
  if (name == "BF16") return StDType::BF16;
  if (name == "F16") return StDType::F16;
  if (name == "I64") return StDType::I64;
  if (name == "I32") return StDType::I32;
  *known = false;
  return StDType::F32;
}

// A JSON number that is a non-negative integer, or nullopt.
bool get_u64(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// src (stored) -> dst (any DType), n elements.
void convert_from_st(StDType from, const void* src, DType to, void* dst, size_t n) {
  switch (from) {
    case StDType::F32: convert(DType::f32, src, to, dst, n); return;
    case StDType::BF16: convert(DType::bf16, src, to, dst, n); return;
    case StDType::F16: convert(DType::f16, src, to, dst, n); return;
    case StDType::F64: {
      float tmp[256];
      const auto* s = static_cast<const double*>(src);
      char* d = static_cast<char*>(dst);
      for (size_t i = 0; i < n; i += 256) {
        size_t m = std::min<size_t>(256, n - i);
        for (size_t j = 0; j < m; ++j) tmp[j] = static_cast<float>(s[i + j]);
        convert(DType::f32, tmp, to, d + i * dtype_size(to), m);
      }
      return;
    }
    default: break;
  }
  fail("internal: integer safetensors dtype {} read as float", st_dtype_name(from));
}

// The header text (JSON padded with spaces so the data section starts 8-byte
// aligned, as the reference writer does), its 8-byte length prefix included;
// tensors laid out back to back in the order given.
template <typename Entries>
// The header padded with spaces (the format allows it) so that the data
// section starts at a multiple of `align` bytes.
std::string header_bytes(const Entries& entries, const std::map<std::string, std::string>& metadata,
                         uint64_t* data_bytes, size_t align = 8) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    const StDType dtype = e.dtype;
    uint64_t bytes = static_cast<uint64_t>(shape_numel(e.shape)) * st_dtype_size(dtype);
    header[e.name] = {{"dtype", st_dtype_name(dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  *data_bytes = offset;
  std::string text = header.dump();
  text.append((align - (8 + text.size()) % align) % align, ' ');
  std::string out(8, '\0');
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(len >> (8 * i));
  return out + text;
}

DType st_to_dtype(StDType dtype) {
  switch (dtype) {
    case StDType::F32: return DType::f32;
    case StDType::BF16: return DType::bf16;
    case StDType::F16: return DType::f16;
    default: break;
  }
  fail("internal: safetensors dtype {} has no DType", st_dtype_name(dtype));
}

}  // namespace

size_t st_dtype_size(StDType dtype) {
  switch (dtype) {
    case StDType::F64:
    case StDType::I64: return 8;
    case StDType::F32:
    case StDType::I32: return 4;
    case StDType::BF16:
    case StDType::F16: return 2;
  }
  return 0;
}

std::string_view st_dtype_name(StDType dtype) {
  switch (dtype) {
    case StDType::F64: return "F64";
    case StDType::F32: return "F32";
    case StDType::BF16: return "BF16";
    case StDType::F16: return "F16";
    case StDType::I64: return "I64";
    case StDType::I32: return "I32";
  }
  return "?";
}

bool st_dtype_is_float(StDType dtype) { return dtype != StDType::I64 && dtype != StDType::I32; }

StDType to_st_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return StDType::F32;
    case DType::bf16: return StDType::BF16;
    case DType::f16: return StDType::F16;
    case DType::i32: return StDType::I32;
  }
  return StDType::F32;
}

// ---------------------------------------------------------------- reader

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  fd_ = UniqueFd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  MESHTRAIN_CHECK_AS(ErrorKind::io, fd_.valid(), "{}: cannot open: {}", path_,
                     std::strerror(errno));
  struct stat st {};
  MESHTRAIN_CHECK_AS(ErrorKind::io, ::fstat(fd_.get(), &st) == 0, "{}: cannot stat: {}", path_,
                     std::strerror(errno));
  const auto file_size = static_cast<uint64_t>(st.st_size);
  MESHTRAIN_CHECK(file_size >= 8,
                  "{}: file is {} bytes, too short for the 8-byte safetensors header length",
                  path_, file_size);

  unsigned char len_bytes[8];
  read_bytes(0, len_bytes, 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, header_len <= file_size - 8,
                     "{}: header length {} exceeds the file size ({} bytes): truncated or not a "
                     "safetensors file",
                     path_, header_len, file_size);
  MESHTRAIN_CHECK(header_len <= kMaxHeaderBytes, "{}: header length {} is larger than {} bytes",
                  path_, header_len, kMaxHeaderBytes);
  data_start_ = 8 + header_len;
  const uint64_t data_size = file_size - data_start_;

  std::string text(header_len, '\0');
  read_bytes(8, text.data(), header_len);

  // nlohmann keeps the last of duplicate keys silently; a parser callback sees
  // every key, so duplicates (tensor names or fields) are caught here.
  std::vector<std::vector<std::string>> open_objects;
  std::string current_tensor;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !open_objects.empty()) {
      auto key = parsed.get<std::string>();
      auto& seen = open_objects.back();
      if (depth == 1) current_tensor = key;
      if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
        if (depth == 1) fail("{}: tensor '{}' appears twice in the header", path_, key);
        fail("{}: tensor '{}': field '{}' appears twice", path_, current_tensor, key);
      }
      seen.push_back(std::move(key));
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, callback);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", path_, e.what());
  }
  MESHTRAIN_CHECK(header.is_object(), "{}: header is not a JSON object", path_);

  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      MESHTRAIN_CHECK(entry.is_object(), "{}: __metadata__ is not an object", path_);
      for (auto& [key, value] : entry.items()) {
        MESHTRAIN_CHECK(value.is_string(), "{}: __metadata__ '{}' is not a string", path_, key);
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    MESHTRAIN_CHECK(entry.is_object(), "{}: tensor '{}': entry is not an object", path_, name);
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      MESHTRAIN_CHECK(entry.contains(field), "{}: tensor '{}': field '{}' is missing", path_, name,
                      field);
    }
    StTensorInfo info;
    info.name = name;
    const json& dtype = entry["dtype"];
    MESHTRAIN_CHECK(dtype.is_string(), "{}: tensor '{}': dtype is not a string", path_, name);
    bool known = false;
    info.dtype = parse_st_dtype(dtype.get<std::string>(), &known);
    MESHTRAIN_CHECK(known, "{}: tensor '{}': unsupported dtype '{}' (expected F32, BF16, F16, F64, "
                    "I64 or I32)", path_, name, dtype.get<std::string>());

    const json& shape = entry["shape"];
    MESHTRAIN_CHECK(shape.is_array(), "{}: tensor '{}': shape is not an array", path_, name);
    uint64_t bytes = st_dtype_size(info.dtype);
    for (const json& d : shape) {
      uint64_t extent = 0;
      MESHTRAIN_CHECK(get_u64(d, &extent) && extent < (uint64_t{1} << 48),
                      "{}: tensor '{}': shape {} is not a list of non-negative integers", path_,
                      name, shape.dump());
      MESHTRAIN_CHECK(!__builtin_mul_overflow(bytes, extent, &bytes),
                      "{}: tensor '{}': shape {} overflows", path_, name, shape.dump());
      info.shape.push_back(static_cast<int64_t>(extent));
    }

    const json& offsets = entry["data_offsets"];
    MESHTRAIN_CHECK(offsets.is_array() && offsets.size() == 2 && get_u64(offsets[0], &info.begin) &&
                        get_u64(offsets[1], &info.end),
                    "{}: tensor '{}': data_offsets {} is not a pair of non-negative integers",
                    path_, name, offsets.dump());
    MESHTRAIN_CHECK(info.begin <= info.end && info.end <= data_size,
                    "{}: tensor '{}': data_offsets [{}, {}] lie outside the data section ({} bytes)",
                    path_, name, info.begin, info.end, data_size);
    MESHTRAIN_CHECK(info.end - info.begin == bytes,
                    "{}: tensor '{}': data_offsets [{}, {}] do not match shape {} of {} ({} bytes)",
                    path_, name, info.begin, info.end, shape_str(info.shape),
                    st_dtype_name(info.dtype), bytes);
    tensors_.push_back(std::move(info));
  }

  std::stable_sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    MESHTRAIN_CHECK(t.begin >= covered, "{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}'",
                    path_, t.name, t.begin, t.end, tensors_[i - 1].name);
    MESHTRAIN_CHECK(t.begin == covered,
                    "{}: tensor '{}': data_offsets [{}, {}] leave bytes [{}, {}) unused", path_,
                    t.name, t.begin, t.end, covered, t.begin);
    covered = t.end;
    index_.emplace(t.name, i);
  }
  MESHTRAIN_CHECK(covered == data_size,
                  "{}: data section is {} bytes but the tensors cover {}: trailing bytes", path_,
                  data_size, covered);
}

void SafetensorsReader::read_bytes(uint64_t file_offset, void* dst, size_t bytes) const {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    ssize_t n = ::pread(fd_.get(), p, bytes, static_cast<off_t>(file_offset));
    if (n < 0 && errno == EINTR) continue;
    MESHTRAIN_CHECK_AS(ErrorKind::io, n >= 0, "{}: read failed: {}", path_, std::strerror(errno));
    MESHTRAIN_CHECK(n > 0, "{}: unexpected end of file at byte {}", path_, file_offset);
    p += n;
    bytes -= static_cast<size_t>(n);
    file_offset += static_cast<uint64_t>(n);
  }
}

const StTensorInfo* SafetensorsReader::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const StTensorInfo& SafetensorsReader::info(std::string_view name) const {
  const StTensorInfo* t = find(name);
  MESHTRAIN_CHECK(t != nullptr, "{}: no tensor named '{}'", path_, name);
  return *t;
}

const std::string& SafetensorsReader::metadata(std::string_view key) const {
  auto it = metadata_.find(std::string(key));
  MESHTRAIN_CHECK(it != metadata_.end(), "{}: __metadata__ has no key '{}'", path_, key);
  return it->second;
}

void SafetensorsReader::read(std::string_view name, const Tensor& dst, bool match_shape) const {
  const StTensorInfo& t = info(name);
  MESHTRAIN_CHECK(st_dtype_is_float(t.dtype), "{}: tensor '{}' has dtype {}, expected a float type",
                  path_, name, st_dtype_name(t.dtype));
  if (match_shape) {
    MESHTRAIN_CHECK(t.shape == dst.shape(), "{}: tensor '{}' has shape {}, expected {}", path_, name,
                    shape_str(t.shape), shape_str(dst.shape()));
  } else {
    MESHTRAIN_CHECK(t.numel() == dst.numel(), "{}: tensor '{}' has {} elements ({}), expected {}",
                    path_, name, t.numel(), shape_str(t.shape), dst.numel());
  }
  const size_t n = static_cast<size_t>(t.numel());
  if (n == 0) return;
  if (t.dtype == to_st_dtype(dst.dtype()) && t.dtype != StDType::F64) {
    read_bytes(data_start_ + t.begin, dst.raw(), n * st_dtype_size(t.dtype));
    return;
  }
  const size_t esize = st_dtype_size(t.dtype);
  std::vector<char> scratch(std::min(n, kChunkElements) * esize);
  char* out = static_cast<char*>(dst.raw());
  for (size_t i = 0; i < n; i += kChunkElements) {
    size_t m = std::min(kChunkElements, n - i);
    read_bytes(data_start_ + t.begin + i * esize, scratch.data(), m * esize);
    convert_from_st(t.dtype, scratch.data(), dst.dtype(), out + i * dtype_size(dst.dtype()), m);
  }
}

Tensor SafetensorsReader::read_tensor(std::string_view name, DType dtype, MemCategory category,
                                      MemoryTracker& tracker) const {
  Tensor out(info(name).shape, dtype, category, tracker);
  read(name, out);
  return out;
}

void SafetensorsReader::read_data(uint64_t offset, void* dst, size_t bytes) const {
  MESHTRAIN_CHECK(offset + bytes <= (tensors_.empty() ? 0 : tensors_.back().end),
                  "{}: bytes [{}, {}) lie outside the data section", path_, offset, offset + bytes);
  read_bytes(data_start_ + offset, dst, bytes);
}

std::vector<int64_t> SafetensorsReader::read_ints(std::string_view name) const {
  const StTensorInfo& t = info(name);
  MESHTRAIN_CHECK(t.dtype == StDType::I64 || t.dtype == StDType::I32,
                  "{}: tensor '{}' has dtype {}, expected I64 or I32", path_, name,
                  st_dtype_name(t.dtype));
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<int64_t> out(n);
  if (t.dtype == StDType::I64) {
    read_bytes(data_start_ + t.begin, out.data(), n * 8);
  } else {
    std::vector<int32_t> narrow(n);
    read_bytes(data_start_ + t.begin, narrow.data(), n * 4);
    std::copy(narrow.begin(), narrow.end(), out.begin());
  }
  return out;
}

// ---------------------------------------------------------------- writer

void SafetensorsWriter::add(std::string name, StDType dtype, Shape shape, const void* data) {
  MESHTRAIN_CHECK(name != "__metadata__", "safetensors: '__metadata__' is not a tensor name");
  for (const Entry& e : entries_) {
    MESHTRAIN_CHECK(e.name != name, "safetensors: tensor '{}' added twice", name);
  }
  for (int64_t d : shape) MESHTRAIN_CHECK(d >= 0, "safetensors: tensor '{}': negative shape", name);
  entries_.push_back(Entry{std::move(name), std::move(shape), dtype, dtype, data});
}

void SafetensorsWriter::add(std::string name, const Tensor& tensor) {
  add(std::move(name), to_st_dtype(tensor.dtype()), tensor.shape(), tensor.raw());
}

void SafetensorsWriter::add(std::string name, const Tensor& tensor, DType stored) {
  add(std::move(name), to_st_dtype(stored), tensor.shape(), tensor.raw());
  entries_.back().source = to_st_dtype(tensor.dtype());
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

void SafetensorsWriter::write(const std::string& path) const {
  struct Declared {
    const std::string& name;
    StDType dtype;
    const Shape& shape;
  };
  std::vector<Declared> declared;
  for (const Entry& e : entries_) declared.push_back(Declared{e.name, e.stored, e.shape});
  uint64_t data_bytes = 0;
  AtomicFile file(path);
  file.write(header_bytes(declared, metadata_, &data_bytes));
  std::vector<char> scratch;
  for (const Entry& e : entries_) {
    const size_t n = static_cast<size_t>(shape_numel(e.shape));
    if (e.source == e.stored) {
      file.write(e.data, n * st_dtype_size(e.stored));
      continue;
    }
    const DType from = st_to_dtype(e.source), to = st_to_dtype(e.stored);
    scratch.resize(std::min(n, kChunkElements) * dtype_size(to));
    const char* src = static_cast<const char*>(e.data);
    for (size_t i = 0; i < n; i += kChunkElements) {
      size_t m = std::min(kChunkElements, n - i);
      convert(from, src + i * dtype_size(from), to, scratch.data(), m);
      file.write(scratch.data(), m * dtype_size(to));
    }
  }
  file.commit();
}

// ---------------------------------------------------------------- streaming writer

struct SafetensorsStreamWriter::Impl {
  AtomicFile file;
  XXH3_state_t* hash = XXH3_createState();
  explicit Impl(std::string path) : file(std::move(path), /*direct=*/true) {
    MESHTRAIN_CHECK(hash != nullptr && XXH3_64bits_reset(hash) == XXH_OK,
                    "{}: cannot start a checksum", file.path());
  }
  ~Impl() { XXH3_freeState(hash); }
};

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path, const std::vector<Entry>& entries,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)) {
  for (size_t i = 0; i < entries.size(); ++i) {
    MESHTRAIN_CHECK(entries[i].name != "__metadata__",
                    "{}: '__metadata__' is not a tensor name", path_);
    for (size_t j = 0; j < i; ++j) {
      MESHTRAIN_CHECK(entries[j].name != entries[i].name, "{}: tensor '{}' declared twice", path_,
                      entries[i].name);
    }
  }
  // Data from 4096 on: aligned writes of it go around the page cache.
  const std::string header = header_bytes(entries, metadata, &data_bytes_, 4096);
  impl_ = std::make_unique<Impl>(path_);
  write_file(header.data(), header.size());
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() = default;

void SafetensorsStreamWriter::write_file(const void* data, size_t bytes) {
  impl_->file.write(data, bytes);
  XXH3_64bits_update(impl_->hash, data, bytes);
  file_bytes_ += bytes;
}

void SafetensorsStreamWriter::write(const void* data, size_t bytes) {
  MESHTRAIN_CHECK(written_ + bytes <= data_bytes_,
                  "{}: {} data bytes written, more than the {} the header declares", path_,
                  written_ + bytes, data_bytes_);
  write_file(data, bytes);
  written_ += bytes;
}

void SafetensorsStreamWriter::commit() {
  MESHTRAIN_CHECK(written_ == data_bytes_, "{}: {} of the {} declared data bytes written", path_,
                  written_, data_bytes_);
  impl_->file.commit();
}

uint64_t SafetensorsStreamWriter::checksum() const { return XXH3_64bits_digest(impl_->hash); }

}  // namespace meshtrain
