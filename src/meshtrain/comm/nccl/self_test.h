// NCCL on one rank and one GPU: every call of the NcclCommunicator run on
// device buffers whose result is known (scripts/gpu_check.sh runs it through
// `meshtrain-ops ops nccl`; tests/cuda too, SKIPPED without a device).
#pragma once

#include <string>
#include <vector>

namespace meshtrain {

struct NcclCheck {
  std::string skipped;             // why nothing ran ("" when it ran)
  std::vector<std::string> lines;  // one per call: "PASS all_reduce f32 sum ..." or "FAIL ..."
  int failed = 0;
};

// device < 0: the process's (cuda::choose_device).
NcclCheck nccl_self_test(int device);

}  // namespace meshtrain
