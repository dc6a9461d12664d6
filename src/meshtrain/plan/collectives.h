// Alpha-beta cost of NCCL-style collectives on one link class. `bytes` is the
// full buffer (all-reduce input, reduce-scatter input, all-gather output), and
// the bandwidth is the nccl-tests bus bandwidth, so the bandwidth terms are
// nccl-tests' busbw factors: all-reduce 2(n-1)/n, reduce-scatter and
// all-gather (n-1)/n, send/recv 1.
#pragma once

#include <cstdint>

#include "meshtrain/plan/hardware.h"

namespace meshtrain::plan {

// Latency: ring 2(n-1) steps, or 2 log2(n) for a tree when that is fewer.
double all_reduce_seconds(double bytes, int64_t n, const Link& link);
double reduce_scatter_seconds(double bytes, int64_t n, const Link& link);
double all_gather_seconds(double bytes, int64_t n, const Link& link);
double send_recv_seconds(double bytes, const Link& link);
// All-to-all of `bytes` per rank (each rank keeps 1/n of it and sends the
// rest, (n-1) exchanges): (n-1) latencies + (n-1)/n bytes at the bus bandwidth.
double all_to_all_seconds(double bytes, int64_t n, const Link& link);

}  // namespace meshtrain::plan
