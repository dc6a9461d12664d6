#include "meshtrain/plan/collectives.h"

#include <algorithm>
#include <cmath>

namespace meshtrain::plan {

double all_reduce_seconds(double bytes, int64_t n, const Link& link) {
  if (n <= 1) return 0;
  const double ranks = static_cast<double>(n);
  const double steps = std::min(2 * (ranks - 1), 2 * std::ceil(std::log2(ranks)));
  return steps * link.latency + 2 * (ranks - 1) / ranks * bytes / link.bus_bandwidth;
}

double reduce_scatter_seconds(double bytes, int64_t n, const Link& link) {
  if (n <= 1) return 0;
  const double ranks = static_cast<double>(n);
  return (ranks - 1) * link.latency + (ranks - 1) / ranks * bytes / link.bus_bandwidth;
}

double all_gather_seconds(double bytes, int64_t n, const Link& link) {
  return reduce_scatter_seconds(bytes, n, link);
}

double all_to_all_seconds(double bytes, int64_t n, const Link& link) {
  return reduce_scatter_seconds(bytes, n, link);  // the same latency and busbw terms
}

double send_recv_seconds(double bytes, const Link& link) {
  return link.latency + bytes / link.bus_bandwidth;
}

}  // namespace meshtrain::plan
