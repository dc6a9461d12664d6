// The safetensors format: an 8-byte little-endian header length N, N bytes of
// JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}), then the raw little-endian data, with
// offsets relative to the end of the header.
//
// The reader trusts no byte: the header length, the JSON, every field, dtype,
// shape and offset range are checked when the file is opened, the tensors
// must tile the data section exactly (no overlap, no hole, no trailing bytes,
// as the reference implementation requires), and every problem is one Error
// naming the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/tensor/tensor.h"
#include "meshtrain/util/unique_fd.h"

namespace meshtrain {

// Element types a safetensors file may hold that meshtrain reads: the float
// types convert to any DType; the integer types hold counters and RNG state.
enum class StDType : uint8_t { F64, F32, BF16, F16, I64, I32 };
size_t st_dtype_size(StDType dtype);
std::string_view st_dtype_name(StDType dtype);  // "F32", ...
bool st_dtype_is_float(StDType dtype);
StDType to_st_dtype(DType dtype);

struct StTensorInfo {
  std::string name;
  StDType dtype = StDType::F32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
  int64_t numel() const { return shape_numel(shape); }
};

class SafetensorsReader {
 public:
  // Opens and validates the whole header; throws Error on any problem.
  explicit SafetensorsReader(std::string path);
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  // In data order (ascending offsets).
  const std::vector<StTensorInfo>& tensors() const { return tensors_; }
  bool contains(std::string_view name) const { return find(name) != nullptr; }
  const StTensorInfo* find(std::string_view name) const;
  const StTensorInfo& info(std::string_view name) const;  // Error "<file>: no tensor named 'x'"
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Error naming the file and key when absent.
  const std::string& metadata(std::string_view key) const;

  // Reads a float tensor into dst (converted to dst's dtype). The stored shape
  // must equal dst's shape (or only its element count when match_shape is false).
  void read(std::string_view name, const Tensor& dst, bool match_shape = true) const;
  // Reads a float tensor into a new tensor of the stored shape.
  Tensor read_tensor(std::string_view name, DType dtype, MemCategory category,
                     MemoryTracker& tracker) const;
  // Reads an I32 or I64 tensor (small: counters, ids, RNG state).
  std::vector<int64_t> read_ints(std::string_view name) const;
  // Raw bytes [offset, offset + bytes) of the data section (offsets as in
  // StTensorInfo), for readers that take parts of a tensor.
  void read_data(uint64_t offset, void* dst, size_t bytes) const;
  // The file offset of the data section (8 + the header's length).
  uint64_t data_start() const { return data_start_; }

 private:
  void read_bytes(uint64_t file_offset, void* dst, size_t bytes) const;

  std::string path_;
  UniqueFd fd_;
  uint64_t data_start_ = 0;  // 8 + header length
  std::vector<StTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors, then writes the file atomically. The data pointed to must
// stay alive until write() returns. Tensors are written in the order added.
class SafetensorsWriter {
 public:
  // Stored exactly as given.
  void add(std::string name, StDType dtype, Shape shape, const void* data);
  // Stored in the tensor's dtype.
  void add(std::string name, const Tensor& tensor);
  // Stored as `stored` (converted while writing, chunk by chunk).
  void add(std::string name, const Tensor& tensor, DType stored);
  void set_metadata(std::string key, std::string value);
  size_t size() const { return entries_.size(); }

  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    Shape shape;
    StDType stored;
    StDType source;
    const void* data;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes a file whose tensors are all declared up front, so the header goes
// first and the data then streams in, in declaration order, from a buffer of
// the caller's size: no tensor is ever held whole. Atomic like
// SafetensorsWriter (temporary file, fsync, rename on commit()), and keeps an
// XXH3-64 checksum of every byte written.
class SafetensorsStreamWriter {
 public:
  struct Entry {
    std::string name;
    StDType dtype = StDType::F32;
    Shape shape;
  };
  SafetensorsStreamWriter(std::string path, const std::vector<Entry>& entries,
                          const std::map<std::string, std::string>& metadata);
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  // The next `bytes` of the data section; Error past the declared size.
  void write(const void* data, size_t bytes);
  // Error unless every declared byte was written; then fsync and rename.
  void commit();

  uint64_t file_bytes() const { return file_bytes_; }  // header included
  uint64_t data_written() const { return written_; }
  uint64_t data_bytes() const { return data_bytes_; }
  uint64_t checksum() const;  // XXH3-64 of the bytes written so far

 private:
  void write_file(const void* data, size_t bytes);

  std::string path_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  uint64_t data_bytes_ = 0, written_ = 0, file_bytes_ = 0;
};

}  // namespace meshtrain
