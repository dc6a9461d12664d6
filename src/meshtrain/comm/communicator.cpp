#include "meshtrain/comm/communicator.h"

#include <algorithm>

#include "meshtrain/util/error.h"

namespace meshtrain {

size_t comm_dtype_size(CommDType dtype) {
  switch (dtype) {
    case CommDType::bf16:
    case CommDType::f16: return 2;
    case CommDType::f32:
    case CommDType::i32: return 4;
    case CommDType::f64:
    case CommDType::i64: return 8;
  }
  return 0;
}

std::string_view comm_dtype_name(CommDType dtype) {
  switch (dtype) {
    case CommDType::f32: return "f32";
    case CommDType::bf16: return "bf16";
    case CommDType::f16: return "f16";
    case CommDType::f64: return "f64";
    case CommDType::i32: return "i32";
    case CommDType::i64: return "i64";
  }
  return "?";
}

CommDType comm_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return CommDType::f32;
    case DType::bf16: return CommDType::bf16;
    case DType::f16: return CommDType::f16;
    case DType::i32: return CommDType::i32;
  }
  fail("comm: dtype {} is not supported by the communicator", dtype_name(dtype));
}

bool is_floating(CommDType dtype) {
  return dtype == CommDType::f32 || dtype == CommDType::bf16 || dtype == CommDType::f64;
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

std::string_view comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::all_reduce: return "all_reduce";
    case CommOp::reduce_scatter: return "reduce_scatter";
    case CommOp::all_gather: return "all_gather";
    case CommOp::broadcast: return "broadcast";
    case CommOp::send: return "send";
    case CommOp::recv: return "recv";
    case CommOp::send_recv: return "send_recv";
    case CommOp::all_to_all: return "all_to_all";
    case CommOp::barrier: return "barrier";
  }
  return "?";
}

void CommTimeline::add(const CallRecord& call, CommClock::time_point wait_began,
                       CommClock::time_point wait_ended) {
  spans_.emplace_back(call.submitted, call.finished);
  const CommClock::time_point begin = std::max(wait_began, call.submitted);
  const CommClock::time_point end = std::min(wait_ended, call.finished);
  if (begin < end) exposed_ += std::chrono::duration<double>(end - begin).count();
}

double CommTimeline::in_flight_seconds() const {
  auto spans = spans_;
  std::sort(spans.begin(), spans.end());
  double total = 0;
  CommClock::time_point covered{};  // the union so far ends here
  for (const auto& [begin, end] : spans) {
    const CommClock::time_point from = std::max(begin, covered);
    if (from < end) total += std::chrono::duration<double>(end - from).count();
    covered = std::max(covered, end);
  }
  return total;
}

OpStats CommStats::total() const {
  OpStats t;
  for (const OpStats& s : ops) {
    t.calls += s.calls;
    t.bytes += s.bytes;
    t.busy_seconds += s.busy_seconds;
  }
  return t;
}

void CommTrace::record(const CallRecord& call) {
  std::lock_guard lock(mutex_);
  OpStats& s = stats_.ops[static_cast<size_t>(call.op)];
  ++s.calls;
  s.bytes += call.bytes;
  s.busy_seconds += call.busy_seconds();
  if (capacity_ == 0) return;
  if (recent_.size() == capacity_) recent_.pop_front();
  recent_.push_back(call);
}

CommStats CommTrace::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::vector<CallRecord> CommTrace::recent() const {
  std::lock_guard lock(mutex_);
  return {recent_.begin(), recent_.end()};
}

void CommTrace::reset() {
  std::lock_guard lock(mutex_);
  stats_ = {};
  recent_.clear();
}

void check_counts(const Communicator& comm, std::string_view call,
                  std::span<const int64_t> counts) {
  MESHTRAIN_CHECK(counts.size() == static_cast<size_t>(comm.size()),
                  "comm {}: {} needs one count per rank ({}), got {}", comm.name(), call,
                  comm.size(), counts.size());
  for (size_t r = 0; r < counts.size(); ++r) {
    MESHTRAIN_CHECK(counts[r] >= 0, "comm {}: {}: count of rank {} is negative ({})", comm.name(),
                    call, r, counts[r]);
  }
}

void check_peer(const Communicator& comm, std::string_view call, int peer, std::string_view what) {
  MESHTRAIN_CHECK(peer >= 0 && peer < comm.size(), "comm {}: {}: {} {} is not a rank in [0, {})",
                  comm.name(), call, what, peer, comm.size());
}

void check_reduce(const Communicator& comm, std::string_view call, CommDType dtype, ReduceOp op) {
  MESHTRAIN_CHECK(dtype != CommDType::f16,
                  "comm {}: {}: f16 is moved, not reduced (reduce in f32)", comm.name(), call);
  MESHTRAIN_CHECK(op != ReduceOp::avg || is_floating(dtype),
                  "comm {}: {}: avg needs a floating type, got {}", comm.name(), call,
                  comm_dtype_name(dtype));
}

bool all_equal(std::span<const int64_t> counts) {
  for (int64_t c : counts) {
    if (c != counts[0]) return false;
  }
  return true;
}

int64_t sum_of(std::span<const int64_t> counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

CallRecord call_record(CommOp op, CommDType dtype, size_t bytes, int peer) {
  CallRecord r;
  r.op = op;
  r.dtype = dtype;
  r.bytes = bytes;
  r.peer = peer;
  return r;
}

}  // namespace meshtrain
