#include "meshtrain/util/error.h"

#include <gtest/gtest.h>

#include <set>

namespace meshtrain {
namespace {

TEST(ErrorKind, EveryKindHasItsOwnExitCodeAndName) {
  std::set<int> codes;
  std::set<std::string_view> names;
  for (int k = 0; k < kErrorKinds; ++k) {
    const auto kind = static_cast<ErrorKind>(k);
    const int code = exit_code(kind);
    // 0 is success, 2 the CLI's usage error, >= 128 a signal's death.
    EXPECT_NE(code, 0);
    EXPECT_NE(code, 2);
    EXPECT_LT(code, 128);
    EXPECT_TRUE(codes.insert(code).second) << error_kind_name(kind);
    EXPECT_TRUE(names.insert(error_kind_name(kind)).second);
    ErrorKind back{};
    ASSERT_TRUE(kind_of_exit_code(code, &back));
    EXPECT_EQ(back, kind);
  }
  ErrorKind unused{};
  EXPECT_FALSE(kind_of_exit_code(0, &unused));
  EXPECT_FALSE(kind_of_exit_code(2, &unused));
  EXPECT_FALSE(kind_of_exit_code(137, &unused));
  EXPECT_EQ(exit_code(ErrorKind::config), 1);  // what every plain MESHTRAIN_CHECK exits with
  EXPECT_EQ(exit_code(ErrorKind::preempted), 75);
}

TEST(ErrorKind, ChecksThrowTheirKind) {
  try {
    MESHTRAIN_CHECK(1 + 1 == 3, "field {} is wrong", "x");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::config);
    EXPECT_STREQ(e.what(), "field x is wrong");
  }
  try {
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt, false, "{}: checksum", "f.safetensors");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::corrupt);
    EXPECT_STREQ(e.what(), "f.safetensors: checksum");
  }
  EXPECT_THROW(fail_as(ErrorKind::timeout, "late"), Error);
}

}  // namespace
}  // namespace meshtrain
