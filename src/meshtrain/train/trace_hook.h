// The timeline trace of a window of steps (train.trace_steps): a StepHook
// that turns the process-wide recorder (util/trace.h) on before the window's
// first step and, after its last step (and whatever evaluation or checkpoint
// follows it), writes out_dir/trace/rank_<R>.json on every rank and
// out_dir/trace/merged.json on rank 0 (one process per rank). docs/trace.md.
//
// Clocks: at construction (collective over the world) the ranks pass a
// barrier and each takes its epoch there; every rank's timestamps are
// relative to its epoch, so the files share one clock up to the barrier's
// exit skew. Each rank's epoch (steady and system clock) and its system-clock
// offset from rank 0 are recorded in the files' otherData.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/step.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {

// "A-B" (steps A to B, 1-based, inclusive) or "N" (step N alone); throws a
// config Error naming train.trace_steps otherwise.
std::pair<int64_t, int64_t> parse_trace_steps(const std::string& spec);

class TraceHook : public StepHook {
 public:
  // mesh: nullptr for a single-process run.
  TraceHook(const std::string& steps, std::string out_dir, DeviceMesh* mesh);

  void before_step(int64_t step) override;
  void on_end() override;

  // Where rank `rank`'s file and the merged file go.
  static std::string rank_file(const std::string& out_dir, int rank);
  static std::string merged_file(const std::string& out_dir);

 private:
  // A communicator of the mesh as the trace names it ("dp[0,2]") and its
  // sequence numbers issued before / after the window.
  struct CommWindow {
    Communicator* comm = nullptr;
    std::string group;
    uint64_t seq_begin = 0, seq_end = 0;
  };
  void finish_window();
  std::string other_json() const;

  int64_t first_ = 0, last_ = 0;
  std::string out_dir_;
  DeviceMesh* mesh_;
  int rank_ = 0, world_size_ = 1;
  bool active_ = false, written_ = false;
  trace::Clock::time_point epoch_;
  // Every rank's epoch: steady ns, system ns (rank 0 needs them for the merge).
  std::vector<int64_t> epochs_;
  std::vector<CommWindow> comms_;
};

}  // namespace meshtrain
