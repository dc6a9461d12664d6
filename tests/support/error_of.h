// The message of the meshtrain::Error a piece of test code throws.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>

#include "meshtrain/util/error.h"

namespace meshtrain::testing {

// The Error message `fn` throws; fails the test when it throws nothing or something else.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a meshtrain::Error: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no Error thrown";
  return {};
}

}  // namespace meshtrain::testing
