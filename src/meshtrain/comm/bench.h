// Communication benchmark: for each collective and message size, the time of
// meshtrain's call (through the communication thread and its work handle) and
// of the same MPI call made directly on that thread (no queue, no handle), in
// the same run, alternating, with the
// nccl-tests definitions of bandwidth:
//   algbw = size / time;  busbw = algbw * factor, factor = 2(n-1)/n for
//   all_reduce, (n-1)/n for reduce_scatter and all_gather, 1 for broadcast
//   and send/recv. `size` is the whole buffer: all_reduce's and broadcast's
//   buffer, reduce_scatter's input, all_gather's output, one send's message.
// send/recv: ranks 2k and 2k+1 ping-pong; time is half a round trip.
// Times are the slowest rank's mean over the iterations.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "meshtrain/comm/mpi.h"

namespace meshtrain {

struct CommBenchOptions {
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 256 << 20;
  int64_t bytes_per_point = 1 << 30;  // iterations = clamp(bytes_per_point / size, 3, 200)
  std::vector<CommOp> ops = {CommOp::all_reduce, CommOp::reduce_scatter, CommOp::all_gather,
                             CommOp::broadcast, CommOp::send};
};

// Sizes 4 KB ... 16 MB, fewer iterations: a quick look (about a second per op on 2 ranks).
CommBenchOptions quick_comm_bench();

struct CommBenchRow {
  CommOp op = CommOp::all_reduce;
  int64_t bytes = 0;
  int iterations = 0;
  double seconds = 0, raw_seconds = 0;                        // per call
  double algbw = 0, busbw = 0, raw_algbw = 0, raw_busbw = 0;  // bytes/s
};

double bus_bandwidth_factor(CommOp op, int ranks);

// Collective over `world`; buffers are counted in `tracker`. on_row sees each
// row as it completes (on every rank).
std::vector<CommBenchRow> run_comm_bench(MpiCommunicator& world, MemoryTracker& tracker,
                                         const CommBenchOptions& options,
                                         const std::function<void(const CommBenchRow&)>& on_row);

std::string comm_bench_header();
std::string format_comm_bench_row(const CommBenchRow& row);

}  // namespace meshtrain
