#include "meshtrain/tensor/tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>

#include "meshtrain/util/error.h"

namespace meshtrain {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string Device::str() const {
  switch (kind) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return fmt::format("cuda:{}", index);
    case DeviceKind::guarded: return "guarded";
  }
  return "?";
}

namespace {

// Zeroes `bytes` in 1 MiB pieces over the OpenMP threads: one core's stores
// reach about 60% of what two reach (a 453 MB gradient buffer: 47 ms on one
// thread, 28 ms on two; docs/benchmarks.md, "Zeroing the gradients").
void zero_bytes(void* data, size_t bytes) {
  constexpr size_t kPiece = size_t{1} << 20;
  const auto pieces = static_cast<int64_t>((bytes + kPiece - 1) / kPiece);
  auto* p = static_cast<char*>(data);
#pragma omp parallel for schedule(static) if (pieces > 4)
  for (int64_t i = 0; i < pieces; ++i) {
    const size_t at = static_cast<size_t>(i) * kPiece;
    std::memset(p + at, 0, std::min(kPiece, bytes - at));
  }
}

// Host buffers of 2 MiB and more are backed by transparent huge pages. Under
// the kernel's default THP mode ("madvise") they would otherwise get 4 KiB
// pages, and the GEMMs' strided reads of cold operands (the experts' weight
// gradients read dY transposed, a row per page) miss the TLB: the fp32 MoE
// step ran 5-15% slower (docs/benchmarks.md, "Huge pages").
constexpr size_t kHugePage = size_t{2} << 20;

class HostAllocator final : public Allocator {
 public:
  Device device() const override { return {}; }
  void* allocate(size_t bytes) const override {
    // Large buffers page-aligned (direct I/O takes them as they are); from
    // kHugePage up, whole huge pages, advised as such before the first touch.
    const size_t align = bytes >= kHugePage ? kHugePage : bytes >= (size_t{1} << 20) ? 4096 : 64;
    const size_t rounded = bytes == 0 ? align : (bytes + align - 1) / align * align;
    void* data = std::aligned_alloc(align, rounded);
    if (data == nullptr) throw std::bad_alloc();
    // Advice only: where the kernel has no transparent huge pages it fails
    // or is ignored, and the buffer keeps 4 KiB pages.
    if (align == kHugePage) static_cast<void>(madvise(data, rounded, MADV_HUGEPAGE));
    zero_bytes(data, rounded);
    return data;
  }
  void release(void* data, size_t) const override { std::free(data); }
  void fill_zero(void* data, size_t bytes) const override { zero_bytes(data, bytes); }
  void copy(DType from, const void* src, DType to, void* dst, size_t n) const override {
    convert(from, src, to, dst, n);
  }
};

}  // namespace

const Allocator& host_allocator() {
  // Never destroyed: a tensor held by another static (a cached backend's
  // scratch) may be freed after this function's statics at exit, and must
  // still find its allocator (UBSan's vptr check caught one in
  // test_cuda_emu). The allocator has no state, so nothing is lost.
  static const Allocator& allocator = *new HostAllocator;
  return allocator;
}

Storage::Storage(size_t bytes, MemCategory category, MemoryTracker& tracker,
                 const Allocator& allocator)
    : bytes_(bytes), category_(category), tracker_(&tracker), allocator_(&allocator) {
  data_ = allocator_->allocate(bytes);
  tracker_->on_alloc(category_, bytes_);
}

Storage::~Storage() {
  allocator_->release(data_, bytes_);
  tracker_->on_free(category_, bytes_);
}

Tensor::Tensor(Shape shape, DType dtype, MemCategory category, MemoryTracker& tracker,
               const Allocator& allocator)
    : shape_(std::move(shape)), numel_(shape_numel(shape_)), dtype_(dtype) {
  MESHTRAIN_CHECK(numel_ >= 0, "negative tensor shape {}", shape_str(shape_));
  storage_ = std::make_shared<Storage>(bytes(), category, tracker, allocator);
}

Tensor Tensor::view(int64_t element_offset, Shape shape) const {
  Tensor out;
  out.storage_ = storage_;
  out.offset_bytes_ = offset_bytes_ + static_cast<size_t>(element_offset) * dtype_size(dtype_);
  out.shape_ = std::move(shape);
  out.numel_ = shape_numel(out.shape_);
  out.dtype_ = dtype_;
  MESHTRAIN_CHECK(element_offset >= 0 && element_offset + out.numel_ <= numel_,
                  "view of {} elements at offset {} exceeds tensor {}", out.numel_, element_offset,
                  shape_str(shape_));
  return out;
}

void Tensor::zero() { storage_->allocator().fill_zero(raw(), bytes()); }

void Tensor::copy_from(const Tensor& other) {
  MESHTRAIN_CHECK(other.numel() == numel_, "copy of {} into {}: element counts differ",
                  shape_str(other.shape()), shape_str(shape_));
  MESHTRAIN_CHECK(other.device() == device(),
                  "copy of a {} tensor into a {} tensor: move it through the backend's "
                  "copy_to_host / copy_from_host",
                  other.device().str(), device().str());
  storage_->allocator().copy(other.dtype(), other.raw(), dtype_, raw(),
                             static_cast<size_t>(numel_));
}

}  // namespace meshtrain
