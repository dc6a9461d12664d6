#include <gtest/gtest.h>

#include <cmath>

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

}  // namespace
}  // namespace meshtrain
