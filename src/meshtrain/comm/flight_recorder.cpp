#include "meshtrain/comm/flight_recorder.h"

#include <algorithm>

namespace meshtrain {

std::string_view call_state_name(CallState state) {
  switch (state) {
    case CallState::queued: return "queued";
    case CallState::running: return "running";
    case CallState::done: return "done";
    case CallState::failed: return "failed";
  }
  return "?";
}

void FlightRecorder::set_capacity(size_t capacity) {
  std::lock_guard lock(mutex_);
  if (capacity == capacity_) return;
  // Keep the newest completed calls, oldest first.
  std::vector<FlightEntry> kept;
  const size_t n = ring_.size();
  for (size_t i = 0; i < n; ++i) kept.push_back(ring_[(ring_next_ + i) % n]);
  if (kept.size() > capacity) {
    kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(capacity));
  }
  ring_ = std::move(kept);
  ring_next_ = ring_.size() == capacity ? 0 : ring_.size();
  capacity_ = capacity;
  if (capacity == 0) pending_.clear();
}

bool FlightRecorder::enabled() const {
  std::lock_guard lock(mutex_);
  return capacity_ > 0;
}

void FlightRecorder::set_timeout(double seconds) {
  std::lock_guard lock(mutex_);
  timeout_s_ = seconds;
}

double FlightRecorder::timeout() const {
  std::lock_guard lock(mutex_);
  return timeout_s_;
}

int FlightRecorder::add_comm(CommIdentity identity) {
  std::lock_guard lock(mutex_);
  comms_.push_back(std::move(identity));
  progress_.emplace_back();
  return static_cast<int>(comms_.size()) - 1;
}

uint64_t FlightRecorder::issue(int comm, const CallRecord& call) {
  std::lock_guard lock(mutex_);
  if (capacity_ == 0) return 0;
  FlightEntry e;
  e.id = next_id_++;
  e.comm = comm;
  e.call = call;
  e.timeout_s = timeout_s_;
  progress_[static_cast<size_t>(comm)].issued = call.seq + 1;
  pending_.emplace(e.id, e);
  return e.id;
}

void FlightRecorder::start(uint64_t id, CommClock::time_point when) {
  if (id == 0) return;
  std::lock_guard lock(mutex_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  it->second.call.started = when;
  it->second.state = CallState::running;
}

void FlightRecorder::finish(uint64_t id, const CallRecord& record, bool failed) {
  if (id == 0) return;
  std::lock_guard lock(mutex_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  FlightEntry e = it->second;
  pending_.erase(it);
  e.call = record;
  e.state = failed ? CallState::failed : CallState::done;
  if (capacity_ == 0) return;
  if (ring_.size() < capacity_) {
    ring_.push_back(e);
    ring_next_ = ring_.size() % capacity_;
  } else {
    ring_[ring_next_] = e;
    ring_next_ = (ring_next_ + 1) % capacity_;
  }
}

FlightSnapshot FlightRecorder::snapshot() const {
  std::lock_guard lock(mutex_);
  FlightSnapshot s;
  s.taken = CommClock::now();
  s.comms = comms_;
  s.progress = progress_;
  for (CommProgress& p : s.progress) p.first_unfinished = p.issued;
  const size_t n = ring_.size();
  const size_t oldest = n < capacity_ ? 0 : ring_next_;
  for (size_t i = 0; i < n; ++i) s.calls.push_back(ring_[(oldest + i) % n]);
  for (const auto& [id, e] : pending_) {
    s.calls.push_back(e);
    CommProgress& p = s.progress[static_cast<size_t>(e.comm)];
    p.first_unfinished = std::min(p.first_unfinished, e.call.seq);
  }
  return s;
}

std::optional<FlightEntry> FlightRecorder::overdue(CommClock::time_point now) const {
  std::lock_guard lock(mutex_);
  std::optional<FlightEntry> worst;
  CommClock::duration worst_late{};
  for (const auto& [id, e] : pending_) {
    if (e.state != CallState::running || e.timeout_s <= 0) continue;
    const auto deadline =
        e.call.started + std::chrono::duration_cast<CommClock::duration>(
                             std::chrono::duration<double>(e.timeout_s));
    if (now <= deadline) continue;
    if (!worst || now - deadline > worst_late) {
      worst = e;
      worst_late = now - deadline;
    }
  }
  return worst;
}

}  // namespace meshtrain
