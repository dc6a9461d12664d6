// The collective layer's contract, independent of the backend (MPI on CPU
// today; NCCL on GPU would be another implementation of the same interface).
//
// Contract:
// - Every call is asynchronous underneath: *_async returns a Work handle; the
//   blocking forms are the async call followed by wait(). Calls on one
//   communicator execute in the order they were issued, and complete in that
//   order. Buffers must stay valid (and, for inputs, unchanged) until the
//   Work completes.
// - Collectives must be issued in the same order on every member, as in MPI.
// - Every call gets a sequence number (per communicator, from 0) and a
//   CallRecord (bytes, submit/start/finish times) kept in stats() and a
//   bounded log of recent calls, so a hang or a slow step can be attributed
//   to one collective.
// - Arguments are validated on the calling thread: a bad count, peer or root
//   throws Error before anything is queued.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/tensor/dtype.h"

namespace meshtrain {

// Element types a communicator moves. bf16 reductions accumulate in f32; f16
// is only moved (gathers, broadcasts, point to point), never reduced: the
// engine reduces gradients in f32.
enum class CommDType : uint8_t { f32, bf16, f64, i32, i64, f16 };
size_t comm_dtype_size(CommDType dtype);
std::string_view comm_dtype_name(CommDType dtype);
CommDType comm_dtype(DType dtype);
bool is_floating(CommDType dtype);

// avg = sum / size (floating types only).
enum class ReduceOp : uint8_t { sum, avg, max };
std::string_view reduce_op_name(ReduceOp op);

enum class CommOp : uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  send,
  recv,
  barrier,
  send_recv,
  all_to_all
};
inline constexpr size_t kCommOps = 9;
std::string_view comm_op_name(CommOp op);

using CommClock = std::chrono::steady_clock;

// One call as issued on this rank. bytes: the payload this rank contributes
// (all_reduce/broadcast/send/recv: the buffer; reduce_scatter: the full
// input; all_gather: the full output; all_to_all: what this rank sends).
struct CallRecord {
  uint64_t seq = 0;
  CommOp op = CommOp::barrier;
  CommDType dtype = CommDType::f32;
  size_t bytes = 0;
  int peer = -1;  // send/recv peer or broadcast root; -1 otherwise
  CommClock::time_point submitted, started, finished;
  double busy_seconds() const { return std::chrono::duration<double>(finished - started).count(); }
};

// A step's collectives timed on one clock (CommClock), so that exposed <=
// in flight always holds: in flight is the wall time during which at least one
// of them was submitted and not yet finished (queueing behind other calls on
// the communication thread included); exposed is the part of it the caller
// spent inside wait() for them (each call's [submitted, finished] cut to its
// wait; waits are sequential on the caller's thread, so they never overlap).
class CommTimeline {
 public:
  // `call` (completed), waited for from wait_began to wait_ended; a call
  // nobody waited for passes the same instant twice.
  void add(const CallRecord& call, CommClock::time_point wait_began,
           CommClock::time_point wait_ended);
  double in_flight_seconds() const;
  double exposed_seconds() const { return exposed_; }

 private:
  std::vector<std::pair<CommClock::time_point, CommClock::time_point>> spans_;
  double exposed_ = 0;
};

struct OpStats {
  uint64_t calls = 0;
  uint64_t bytes = 0;
  double busy_seconds = 0;  // sum of (finished - started)
};

struct CommStats {
  std::array<OpStats, kCommOps> ops{};
  const OpStats& operator[](CommOp op) const { return ops[static_cast<size_t>(op)]; }
  OpStats total() const;
};

// Completed-call bookkeeping shared by backends: stats and a ring of recent calls.
class CommTrace {
 public:
  explicit CommTrace(size_t capacity = 1024) : capacity_(capacity) {}
  void record(const CallRecord& call);
  CommStats stats() const;
  std::vector<CallRecord> recent() const;  // oldest first
  void reset();

 private:
  mutable std::mutex mutex_;
  size_t capacity_;
  CommStats stats_;
  std::deque<CallRecord> recent_;
};

// One transfer of a send_recv_async batch.
struct P2POp {
  bool send = true;
  void* data = nullptr;  // send: read from; recv: written (exactly count elements)
  int64_t count = 0;
  CommDType dtype = CommDType::f32;
  int peer = 0;
  int tag = 0;
};

// A handle on an issued call. A default-constructed Work is already complete.
class Work {
 public:
  // Backend side of a handle.
  class State {
   public:
    virtual ~State() = default;
    virtual void wait() = 0;                // rethrows the call's error, if any
    virtual bool test() = 0;                // true once complete (without blocking)
    virtual CallRecord record() const = 0;  // complete once test() is true
  };

  Work() = default;
  Work(std::shared_ptr<State> state, uint64_t seq) : state_(std::move(state)), seq_(seq) {}

  void wait() {
    if (state_) state_->wait();
  }
  bool test() { return !state_ || state_->test(); }
  uint64_t seq() const { return seq_; }
  // Timestamps and size of the call; valid after wait() or a true test().
  CallRecord record() const { return state_ ? state_->record() : CallRecord{}; }

 private:
  std::shared_ptr<State> state_;
  uint64_t seq_ = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  // "world", "dp", "tp", "pp", ...

  // In place over `count` elements of `data`.
  virtual Work all_reduce_async(void* data, int64_t count, CommDType dtype, ReduceOp op) = 0;
  // `send` holds sum(counts) elements laid out by rank; rank r receives the
  // reduction of its part (counts[r] elements) in `recv`. counts.size() == size().
  virtual Work reduce_scatter_async(const void* send, void* recv, std::span<const int64_t> counts,
                                    CommDType dtype, ReduceOp op) = 0;
  // Rank r contributes counts[r] elements from `send`; `recv` gets all parts
  // in rank order. send may be recv + (offset of this rank's part): in place.
  virtual Work all_gather_async(const void* send, void* recv, std::span<const int64_t> counts,
                                CommDType dtype) = 0;
  virtual Work broadcast_async(void* data, int64_t count, CommDType dtype, int root) = 0;
  // All-to-all with per-rank counts (MPI_Alltoallv): `send` holds
  // sum(send_counts) elements laid out by destination rank, `recv` gets
  // sum(recv_counts) laid out by source rank. recv_counts[r] must equal what
  // rank r sends here (exchange the counts first: an all_to_all of one count
  // per rank). Both spans have size() entries. Moves any dtype (no reduction).
  virtual Work all_to_all_async(const void* send, std::span<const int64_t> send_counts, void* recv,
                                std::span<const int64_t> recv_counts, CommDType dtype) = 0;
  // Point to point. A blocking send may wait for the matching recv: order
  // pairs so that they cannot cross (as with MPI_Send).
  virtual Work send_async(const void* data, int64_t count, CommDType dtype, int peer,
                          int tag = 0) = 0;
  virtual Work recv_async(void* data, int64_t count, CommDType dtype, int peer, int tag = 0) = 0;
  virtual Work barrier_async() = 0;
  // Posts every transfer of `ops` at once and completes when all have been
  // matched (one call, CommOp::send_recv, bytes = the sum, peer = the first
  // op's). Unlike every other call it does not hold up later calls: they run
  // while its transfers are pending, and it may complete after them. So a
  // pending send (a peer not yet receiving) never delays this rank's next
  // receive or collective. Pipeline schedules move activations this way.
  virtual Work send_recv_async(std::vector<P2POp> ops) = 0;

  // A new communicator over the members that pass the same color, ordered by
  // key (collective over this communicator).
  virtual std::unique_ptr<Communicator> split(int color, int key, std::string name) = 0;

  virtual CommStats stats() const = 0;
  virtual std::vector<CallRecord> recent_calls() const = 0;
  virtual uint64_t calls_issued() const = 0;  // the next call's sequence number

  // Blocking forms.
  void all_reduce(void* data, int64_t count, CommDType dtype, ReduceOp op) {
    all_reduce_async(data, count, dtype, op).wait();
  }
  void reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts,
                      CommDType dtype, ReduceOp op) {
    reduce_scatter_async(send, recv, counts, dtype, op).wait();
  }
  void all_gather(const void* send, void* recv, std::span<const int64_t> counts, CommDType dtype) {
    all_gather_async(send, recv, counts, dtype).wait();
  }
  void broadcast(void* data, int64_t count, CommDType dtype, int root) {
    broadcast_async(data, count, dtype, root).wait();
  }
  void send(const void* data, int64_t count, CommDType dtype, int peer, int tag = 0) {
    send_async(data, count, dtype, peer, tag).wait();
  }
  void recv(void* data, int64_t count, CommDType dtype, int peer, int tag = 0) {
    recv_async(data, count, dtype, peer, tag).wait();
  }
  void barrier() { barrier_async().wait(); }
  void all_to_all(const void* send, std::span<const int64_t> send_counts, void* recv,
                  std::span<const int64_t> recv_counts, CommDType dtype) {
    all_to_all_async(send, send_counts, recv, recv_counts, dtype).wait();
  }

  // Even parts: every rank's part has `count_per_rank` elements.
  void reduce_scatter(const void* send, void* recv, int64_t count_per_rank, CommDType dtype,
                      ReduceOp op) {
    std::vector<int64_t> counts(static_cast<size_t>(size()), count_per_rank);
    reduce_scatter(send, recv, counts, dtype, op);
  }
  void all_gather(const void* send, void* recv, int64_t count_per_rank, CommDType dtype) {
    std::vector<int64_t> counts(static_cast<size_t>(size()), count_per_rank);
    all_gather(send, recv, counts, dtype);
  }
};

// Checks the arguments every backend shares; throws Error naming the
// communicator, the call and the bad value.
void check_counts(const Communicator& comm, std::string_view call, std::span<const int64_t> counts);
void check_peer(const Communicator& comm, std::string_view call, int peer, std::string_view what);
void check_reduce(const Communicator& comm, std::string_view call, CommDType dtype, ReduceOp op);

// Helpers every backend's calls share.
bool all_equal(std::span<const int64_t> counts);
int64_t sum_of(std::span<const int64_t> counts);
CallRecord call_record(CommOp op, CommDType dtype, size_t bytes, int peer = -1);

}  // namespace meshtrain
