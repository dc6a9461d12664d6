#include "meshtrain/util/error.h"

#include <array>

namespace meshtrain {
namespace {

struct KindInfo {
  std::string_view name;
  int exit_code;
};
constexpr std::array<KindInfo, kErrorKinds> kKinds = {{{"config", 1},
                                                       {"io", 3},
                                                       {"corrupt", 4},
                                                       {"diverged", 5},
                                                       {"peer", 6},
                                                       {"timeout", 7},
                                                       {"resource", 8},
                                                       {"busy", 9},
                                                       {"preempted", 75}}};

}  // namespace

std::string_view error_kind_name(ErrorKind kind) { return kKinds[static_cast<size_t>(kind)].name; }

int exit_code(ErrorKind kind) { return kKinds[static_cast<size_t>(kind)].exit_code; }

bool kind_of_exit_code(int code, ErrorKind* kind) {
  for (size_t i = 0; i < kKinds.size(); ++i) {
    if (kKinds[i].exit_code == code) {
      *kind = static_cast<ErrorKind>(i);
      return true;
    }
  }
  return false;
}

}  // namespace meshtrain
