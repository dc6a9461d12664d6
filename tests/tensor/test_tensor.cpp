#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "meshtrain/tensor/tensor.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

TEST(MemoryTracker, CountsLiveAndPeakByCategory) {
  MemoryTracker tracker;
  {
    Tensor a({4, 8}, DType::f32, MemCategory::params, tracker);
    Tensor g({4, 8}, DType::bf16, MemCategory::grads, tracker);
    EXPECT_EQ(tracker.live(MemCategory::params), 128u);
    EXPECT_EQ(tracker.live(MemCategory::grads), 64u);
    {
      Tensor tmp({100}, DType::f32, MemCategory::workspace, tracker);
      EXPECT_EQ(tracker.live_total(), 592u);
    }
    EXPECT_EQ(tracker.live(MemCategory::workspace), 0u);
    EXPECT_EQ(tracker.peak(MemCategory::workspace), 400u);
    EXPECT_EQ(tracker.peak_total(), 592u);
    Tensor v = a.view(8, {2, 8});  // views share storage, counted once
    EXPECT_EQ(tracker.live(MemCategory::params), 128u);
  }
  EXPECT_EQ(tracker.live_total(), 0u);
  tracker.reset_peaks();
  EXPECT_EQ(tracker.peak_total(), 0u);
}

TEST(Tensor, ViewsAliasAndCheckBounds) {
  MemoryTracker tracker;
  Tensor a({3, 4}, DType::f32, MemCategory::activations, tracker);
  Tensor row1 = a.view(4, {4});
  row1.data<float>()[2] = 7.0f;
  EXPECT_EQ(a.data<float>()[6], 7.0f);
  EXPECT_THROW(a.view(10, {4}), Error);
}

// Host zeroing runs in 1 MiB pieces over the threads: a view that starts
// and ends off a piece's bound is zeroed exactly, its neighbours untouched.
TEST(Tensor, ZeroCoversALargeViewExactly) {
  MemoryTracker tracker;
  const int64_t n = (int64_t{6} << 20) / 4 + 1000;
  Tensor a({n}, DType::f32, MemCategory::grads, tracker);
  float* x = a.data<float>();
  for (int64_t i = 0; i < n; ++i) x[i] = 1.0f;
  a.view(3, {n - 5}).zero();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[i], i < 3 || i >= n - 2 ? 1.0f : 0.0f) << i;
}

// The VmFlags line of the /proc/self/smaps mapping that holds address p.
std::string mapping_flags(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> lo >> dash >> hi && dash == '-') {  // a mapping's first line
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

// Host buffers of 2 MiB and more start on a huge page and carry the huge-page
// advice (VmFlags "hg"); smaller ones do not.
TEST(Tensor, LargeHostBuffersAreAdvisedAsHugePages) {
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  MemoryTracker tracker;
  Tensor large({(int64_t{3} << 20) / 4}, DType::f32, MemCategory::grads, tracker);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large.raw()) % (uintptr_t{2} << 20), 0u);
  EXPECT_NE(mapping_flags(large.raw()).find(" hg"), std::string::npos) << mapping_flags(large.raw());
  Tensor small({(int64_t{1} << 20) / 4}, DType::f32, MemCategory::grads, tracker);
  EXPECT_EQ(mapping_flags(small.raw()).find(" hg"), std::string::npos) << mapping_flags(small.raw());
}

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly between two bf16 values; ties go to even (1.0).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3*2^-8 ties up to 1 + 2^-6.
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(f16_to_float(float_to_f16(0.5f)), 0.5f);
}

TEST(Tensor, CopyConvertsDtypes) {
  MemoryTracker tracker;
  Tensor a({5}, DType::f32, MemCategory::workspace, tracker);
  for (int i = 0; i < 5; ++i) a.data<float>()[i] = 0.25f * static_cast<float>(i);
  Tensor b({5}, DType::bf16, MemCategory::workspace, tracker);
  b.copy_from(a);
  Tensor c({5}, DType::f32, MemCategory::workspace, tracker);
  c.copy_from(b);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(c.data<float>()[i], a.data<float>()[i]);
  EXPECT_THROW(parse_dtype("f64"), Error);
}

// A device whose memory is host memory underneath, counting the moves it is asked for.
class CountingDevice final : public Allocator {
 public:
  Device device() const override { return {DeviceKind::cuda, 0}; }
  void* allocate(size_t bytes) const override { return host_allocator().allocate(bytes); }
  void release(void* data, size_t bytes) const override { host_allocator().release(data, bytes); }
  void fill_zero(void* data, size_t bytes) const override {
    ++zeroes;
    host_allocator().fill_zero(data, bytes);
  }
  void copy(DType from, const void* src, DType to, void* dst, size_t n) const override {
    ++copies;
    host_allocator().copy(from, src, to, dst, n);
  }
  mutable int zeroes = 0, copies = 0;
};

TEST(Tensor, ZeroAndCopyGoThroughTheTensorsDevice) {
  MemoryTracker tracker;
  CountingDevice device;
  Tensor a({4}, DType::f32, MemCategory::workspace, tracker, device);
  Tensor b({4}, DType::bf16, MemCategory::workspace, tracker, device);
  EXPECT_EQ(a.device().str(), "cuda:0");
  a.view(1, {2}).zero();
  b.copy_from(a);
  EXPECT_EQ(device.zeroes, 1);
  EXPECT_EQ(device.copies, 1);
  // Between devices only the backend moves bytes (copy_to_host / copy_from_host).
  Tensor host({4}, DType::f32, MemCategory::workspace, tracker);
  try {
    host.copy_from(a);
    FAIL() << "a copy from cuda:0 into cpu was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("copy of a cuda:0 tensor into a cpu tensor"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(device.copies, 1);
}

}  // namespace
}  // namespace meshtrain
