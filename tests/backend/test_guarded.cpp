// The guarded backend (backend/guarded): tensors the host cannot touch outside
// the backend's ops. A host read of a tensor aborts naming the access; an op
// given host memory throws naming the op and the argument; copies and ops see
// the data; an allocation inside an open scope is usable there and guarded after.
#include <gtest/gtest.h>

#include <vector>

#include "meshtrain/backend/guarded/guarded_memory.h"
#include "meshtrain/backend/registry.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

using guarded::GuardedMemory;

struct Guarded : ::testing::Test {
  MemoryTracker tracker;
  std::unique_ptr<Backend> backend = make_backend("guarded", 1, tracker);
};

TEST_F(Guarded, CopiesAndOpsSeeTheData) {
  EXPECT_STREQ(backend->name(), "guarded");
  Tensor x = backend->allocate({4}, DType::f32, MemCategory::activations);
  Tensor y = backend->allocate({4}, DType::f32, MemCategory::activations);
  EXPECT_TRUE(GuardedMemory::instance().contains(x.raw()));
  const std::vector<float> a{1, 2, 3, 4}, b{10, 20, 30, 40};
  backend->copy_from_host(a.data(), x);
  backend->copy_from_host(b.data(), y);
  backend->add_inplace(x.data<float>(), y.data<float>(), 4);
  std::vector<float> out(4);
  backend->copy_to_host(x, out.data());
  EXPECT_EQ(out, (std::vector<float>{11, 22, 33, 44}));
  EXPECT_EQ(backend->sum_squares(y.data<float>(), 4), 100.0 + 400 + 900 + 1600);
}

TEST_F(Guarded, AnOpGivenHostMemoryIsRefusedNamingTheArgument) {
  Tensor x = backend->allocate({4}, DType::f32, MemCategory::activations);
  std::vector<float> host(4, 1.0f);
  try {
    backend->add_inplace(x.data<float>(), host.data(), 4);
    ADD_FAILURE() << "add_inplace took host memory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("guarded backend: add_inplace was given host memory"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("pointer argument 1"), std::string::npos) << e.what();
  }
}

TEST_F(Guarded, AnAllocationInsideAnOpenScopeIsGuardedAfterIt) {
  Tensor t;
  {
    const GuardedMemory::Open open;
    t = backend->allocate({2}, DType::f32, MemCategory::workspace);
    t.data<float>()[1] = 5.0f;  // usable while open
  }
  float back[2] = {};
  backend->copy_to_host(t, back);
  EXPECT_EQ(back[1], 5.0f);
  EXPECT_DEATH((void)*static_cast<volatile float*>(t.data<float>()), "host access to device memory");
}

TEST(GuardedDeathTest, AHostReadOfATensorAbortsNamingTheAccess) {
  MemoryTracker tracker;
  const std::unique_ptr<Backend> backend = make_backend("guarded", 1, tracker);
  const Tensor x = backend->allocate({1024}, DType::f32, MemCategory::params);
  EXPECT_DEATH((void)static_cast<volatile float*>(x.data<float>())[100],
               "guarded backend: host access to device memory at 0x[0-9a-f]+ \\(a block of 4096 "
               "bytes");
}

}  // namespace
}  // namespace meshtrain
