// A dense, row-major tensor on one device. Storage comes from that device's
// Allocator (host memory, 64-byte aligned, unless a backend passes its own),
// is counted by a MemoryTracker under one category, and is shared between a
// tensor and its views (a view keeps the storage alive; it is not counted twice).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/tensor/dtype.h"
#include "meshtrain/tensor/memory_tracker.h"

namespace meshtrain {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[2, 3]"

// guarded: host memory the host may not touch (backend/guarded, a check of the engine).
enum class DeviceKind : uint8_t { cpu, cuda, guarded };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  bool is_host() const { return kind == DeviceKind::cpu; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:1"
};

// Where a device's bytes come from, and the moves inside that device's memory
// (ggml-backend's buffer interface in small): a tensor is zeroed and copied by
// its own allocator, so Tensor::zero and Tensor::copy_from work on any device;
// moves between host and device go through the Backend. allocate returns
// zero-filled memory or throws std::bad_alloc; release gets back what
// allocate returned.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual void* allocate(size_t bytes) const = 0;
  virtual void release(void* data, size_t bytes) const = 0;
  // Sets `bytes` bytes at `data` (this device's) to zero.
  virtual void fill_zero(void* data, size_t bytes) const = 0;
  // Copies n elements from src to dst (both this device's), converting when
  // the dtypes differ (round to nearest even, as `convert`).
  virtual void copy(DType from, const void* src, DType to, void* dst, size_t n) const = 0;
};
// Host memory: 64-byte aligned, 4096 from 1 MiB (direct I/O takes it as it is).
const Allocator& host_allocator();

// Tracked bytes of one device. Zero-filled on creation.
class Storage {
 public:
  Storage(size_t bytes, MemCategory category, MemoryTracker& tracker,
          const Allocator& allocator = host_allocator());
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  Device device() const { return allocator_->device(); }
  const Allocator& allocator() const { return *allocator_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_;
  MemoryTracker* tracker_;
  const Allocator* allocator_;
};

class Tensor {
 public:
  Tensor() = default;
  // Allocates a zero-filled tensor (in host memory unless `allocator` says otherwise).
  Tensor(Shape shape, DType dtype, MemCategory category, MemoryTracker& tracker,
         const Allocator& allocator = host_allocator());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  size_t rank() const { return shape_.size(); }
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  size_t bytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  Device device() const { return storage_ ? storage_->device() : Device{}; }

  void* raw() const { return static_cast<char*>(storage_->data()) + offset_bytes_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }

  // A tensor over `shape` starting `element_offset` elements into this one; shares storage.
  Tensor view(int64_t element_offset, Shape shape) const;
  // Same elements, another shape with the same numel.
  Tensor reshape(Shape shape) const { return view(0, std::move(shape)); }

  // On the tensor's own device, through its allocator.
  void zero();
  // Copies all elements from `other` (same numel, same device), converting
  // dtype if needed.
  void copy_from(const Tensor& other);

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::f32;
};

}  // namespace meshtrain
