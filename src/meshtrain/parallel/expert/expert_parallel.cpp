#include "meshtrain/parallel/expert/expert_parallel.h"

#include <numeric>

#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

int64_t total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// fn(source-major offset, expert-major offset, rows) for every (source p,
// local expert l) block: by source, [p][l] blocks follow each other; by
// expert, [l][p] do.
template <typename Fn>
void for_each_block(const ExpertExchange& plan, Fn&& fn) {
  const auto ep = static_cast<int64_t>(plan.recv_rows.size());
  const int64_t el = plan.local_experts;
  std::vector<int64_t> expert_base(static_cast<size_t>(el), 0);
  for (int64_t l = 1; l < el; ++l) {
    expert_base[static_cast<size_t>(l)] =
        expert_base[static_cast<size_t>(l - 1)] + plan.expert_rows[static_cast<size_t>(l - 1)];
  }
  int64_t source_offset = 0;
  for (int64_t p = 0; p < ep; ++p) {
    for (int64_t l = 0; l < el; ++l) {
      const int64_t rows = plan.recv_counts[static_cast<size_t>(p * el + l)];
      int64_t& expert_offset = expert_base[static_cast<size_t>(l)];
      if (rows > 0) fn(source_offset, expert_offset, rows);
      source_offset += rows;
      expert_offset += rows;
    }
  }
}

std::vector<int64_t> scaled(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows);
  for (int64_t& v : out) v *= width;
  return out;
}

char* byte_at(void* p, DType dt, int64_t row, int64_t width) {
  return static_cast<char*>(p) + row * width * static_cast<int64_t>(dtype_size(dt));
}
const char* byte_at(const void* p, DType dt, int64_t row, int64_t width) {
  return static_cast<const char*>(p) + row * width * static_cast<int64_t>(dtype_size(dt));
}

}  // namespace

int64_t ExpertExchange::sent() const { return total(send_rows); }
int64_t ExpertExchange::received() const { return total(recv_rows); }

ExpertExchange plan_exchange(const ExpertParallel& ep, std::span<const int32_t> rows_per_expert) {
  const int n = ep.size();
  const auto experts = static_cast<int64_t>(rows_per_expert.size());
  MESHTRAIN_CHECK(experts % n == 0, "expert parallel: {} experts do not split over ep {}",
                  experts, n);
  ExpertExchange plan;
  plan.local_experts = experts / n;
  const int64_t el = plan.local_experts;
  std::vector<int64_t> mine(rows_per_expert.begin(), rows_per_expert.end());
  plan.send_rows.assign(static_cast<size_t>(n), 0);
  for (int64_t e = 0; e < experts; ++e) plan.send_rows[static_cast<size_t>(e / el)] += mine[static_cast<size_t>(e)];
  plan.recv_counts.assign(static_cast<size_t>(experts), 0);
  if (ep.active()) {
    const std::vector<int64_t> each(static_cast<size_t>(n), el);
    ep.comm->all_to_all(mine.data(), each, plan.recv_counts.data(), each, CommDType::i64);
  } else {
    plan.recv_counts = mine;
  }
  plan.recv_rows.assign(static_cast<size_t>(n), 0);
  plan.expert_rows.assign(static_cast<size_t>(el), 0);
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t l = 0; l < el; ++l) {
      const int64_t rows = plan.recv_counts[static_cast<size_t>(p * el + l)];
      plan.recv_rows[static_cast<size_t>(p)] += rows;
      plan.expert_rows[static_cast<size_t>(l)] += static_cast<int32_t>(rows);
    }
  }
  return plan;
}

void dispatch_rows(const ExpertParallel& ep, const ExpertExchange& plan, Backend& backend,
                   DType dt, int64_t width, const void* token, void* staging, void* expert) {
  MESHTRAIN_CHECK(ep.active(), "expert parallel: dispatch_rows needs an ep group");
  backend.synchronize();  // the token rows are complete before MPI reads them
  ep.comm->all_to_all(token, scaled(plan.send_rows, width), staging,
                      scaled(plan.recv_rows, width), comm_dtype(dt));
  for_each_block(plan, [&](int64_t by_source, int64_t by_expert, int64_t rows) {
    backend.convert(dt, byte_at(staging, dt, by_source, width), dt,
                    byte_at(expert, dt, by_expert, width), rows * width);
  });
}

void combine_rows(const ExpertParallel& ep, const ExpertExchange& plan, Backend& backend,
                  DType dt, int64_t width, const void* expert, void* staging, void* token) {
  MESHTRAIN_CHECK(ep.active(), "expert parallel: combine_rows needs an ep group");
  for_each_block(plan, [&](int64_t by_source, int64_t by_expert, int64_t rows) {
    backend.convert(dt, byte_at(expert, dt, by_expert, width), dt,
                    byte_at(staging, dt, by_source, width), rows * width);
  });
  backend.synchronize();
  ep.comm->all_to_all(staging, scaled(plan.recv_rows, width), token,
                      scaled(plan.send_rows, width), comm_dtype(dt));
}

}  // namespace meshtrain
