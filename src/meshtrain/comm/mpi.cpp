#include "meshtrain/comm/mpi.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <vector>
#include <thread>

#include <fmt/ranges.h>

#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {

// The single thread that makes every MPI call between init and finalize.
class CommThread {
 public:
  CommThread() : thread_([this] { loop(); }) {}
  ~CommThread() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }

  void post(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
  }

  // Callers blocked in Work::wait() on any call of this thread (all
  // communicators): while one waits, requests are awaited at full speed
  // (see await_request in this file).
  std::atomic<int> waiters{0};

  // Requests that stay posted while the thread runs later calls
  // (send_recv_async); `done` runs on this thread once all have completed or
  // MPI_Testall failed (rc). Only the thread itself adds them.
  struct Outstanding {
    std::vector<MPI_Request> requests;
    std::function<void(const std::vector<MPI_Status>&, int rc)> done;
  };
  void add_outstanding(Outstanding o) { outstanding_.push_back(std::move(o)); }

  // Posts and waits; rethrows the task's exception.
  void run(const std::function<void()>& task) {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
    post([&] {
      try {
        task();
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(m);
      done = true;
      cv.notify_one();
    });
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return done; });
    if (error) std::rethrow_exception(error);
  }

 private:
  void loop() {
    // While requests are outstanding the thread tests them between calls and
    // otherwise sleeps 20 to 500 us (a waiting caller: no sleep), as await_request.
    auto pause = std::chrono::microseconds(20);
    trace::set_thread_name("comm");
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        auto woken = [&] { return stop_ || !queue_.empty(); };
        if (outstanding_.empty()) {
          ready_.wait(lock, woken);
        } else if (waiters.load() == 0) {
          ready_.wait_for(lock, pause, woken);
        }
        if (!queue_.empty()) {
          task = std::move(queue_.front());
          queue_.pop_front();
        } else if (stop_) {
          return;  // drained
        }
      }
      if (task) task();
      if (outstanding_.empty()) continue;
      if (poll_outstanding() || task) {
        pause = std::chrono::microseconds(20);
      } else {
        pause = std::min(pause * 2, std::chrono::microseconds(500));
      }
    }
  }

  // True when a call completed.
  bool poll_outstanding() {
    bool any = false;
    for (size_t i = 0; i < outstanding_.size();) {
      Outstanding& o = outstanding_[i];
      std::vector<MPI_Status> statuses(o.requests.size());
      int flag = 0;
      const int rc = MPI_Testall(static_cast<int>(o.requests.size()), o.requests.data(), &flag,
                                 statuses.data());
      if (rc != MPI_SUCCESS || flag) {
        auto done = std::move(o.done);
        outstanding_.erase(outstanding_.begin() + static_cast<std::ptrdiff_t>(i));
        done(statuses, rc);
        any = true;
      } else {
        ++i;
      }
    }
    return any;
  }

  std::vector<Outstanding> outstanding_;  // the thread's own

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

namespace {

// The completion side of one call.
class MpiWork final : public Work::State {
 public:
  explicit MpiWork(CommThread& thread) : thread_(thread) {}
  void wait() override {
    std::unique_lock lock(mutex_);
    if (!done_) {
      ++thread_.waiters;
      done_cv_.wait(lock, [&] { return done_; });
      --thread_.waiters;
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool test() override {
    std::lock_guard lock(mutex_);
    return done_;
  }
  CallRecord record() const override {
    std::lock_guard lock(mutex_);
    return record_;
  }
  void complete(const CallRecord& record, std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      record_ = record;
      error_ = std::move(error);
      done_ = true;
    }
    done_cv_.notify_all();
  }

 private:
  CommThread& thread_;
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
  CallRecord record_;
};

// MPI counts and displacements are ints; larger calls are split (all_reduce,
// broadcast) or refused.
constexpr int64_t kMaxChunk = int64_t{1} << 30;

void check_mpi(int rc, const std::string& comm, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail_as(ErrorKind::peer, "comm {}: {} failed: {}", comm, call,
          std::string(text, static_cast<size_t>(len)));
}

// Waiting for peers without spinning. MPI's blocking calls busy-poll, and
// on a CPU the communication thread shares the cores with the compute
// threads: waiting for a peer that is still in its backward would cost a
// core. So, unless a caller is already waiting on this thread (then the
// cores are idle anyway), a request is tested with the thread asleep in
// between, the sleeps growing from 20 us to 500 us (a test costs ~20 us of
// MPI progress); once a caller waits, MPI_Wait.
MPI_Status await_request(CommThread& thread, MPI_Request& request, const std::string& comm,
                         const char* call) {
  MPI_Status status{};
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    if (thread.waiters.load() > 0) {
      check_mpi(MPI_Wait(&request, &status), comm, call);
      return status;
    }
    int done = 0;
    check_mpi(MPI_Test(&request, &done, &status), comm, call);
    if (done) return status;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(500));
  }
}

// Collectives of at least this many bytes (in total, the same on every rank,
// so every rank takes the same path) first meet in a nonblocking barrier
// awaited as above; the blocking collective (MPI's tuned algorithms) then
// starts with every peer present, so it hardly spins. Blocking and
// nonblocking collectives never match each other in MPI, hence a barrier
// rather than switching the collective itself.
constexpr size_t kHandshakeBytes = size_t{64} << 10;

void collective(CommThread& thread, MPI_Comm mpi_comm, size_t total_bytes, const std::string& comm,
                const char* call, const std::function<int()>& blocking) {
  if (total_bytes >= kHandshakeBytes) {
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibarrier(mpi_comm, &request), comm, call);
    await_request(thread, request, comm, call);
  }
  check_mpi(blocking(), comm, call);
}

MPI_Datatype mpi_type(CommDType dtype) {
  switch (dtype) {
    case CommDType::f32: return MPI_FLOAT;
    case CommDType::bf16: return MPI_UINT16_T;  // moved as bits; reduced through f32
    case CommDType::f16: return MPI_UINT16_T;   // moved as bits; never reduced
    case CommDType::f64: return MPI_DOUBLE;
    case CommDType::i32: return MPI_INT32_T;
    case CommDType::i64: return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

template <typename T>
void divide(void* data, int64_t n, int by) {
  T* p = static_cast<T*>(data);
  const T d = static_cast<T>(by);
  for (int64_t i = 0; i < n; ++i) p[i] /= d;
}

// Serial on purpose: OpenMP on the communication thread would start a second
// thread team competing with the compute threads.
void bf16_to_f32(const void* src, float* dst, int64_t n) {
  const bf16* s = static_cast<const bf16*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
}

void f32_to_bf16(const float* src, void* dst, int64_t n) {
  bf16* d = static_cast<bf16*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
}

void check_int_range(const Communicator& comm, std::string_view call, int64_t total) {
  MESHTRAIN_CHECK(total <= INT_MAX, "comm {}: {} of {} elements exceeds MPI's int counts",
                  comm.name(), call, total);
}

// Checks a send or recv and describes it.
CallRecord p2p_record(const Communicator& comm, CommOp op, int64_t count, CommDType dtype,
                      int peer) {
  const std::string_view call = comm_op_name(op);
  check_peer(comm, call, peer, "peer");
  MESHTRAIN_CHECK(count >= 0, "comm {}: {}: negative count {}", comm.name(), call, count);
  check_int_range(comm, call, count);
  return call_record(op, dtype, static_cast<size_t>(count) * comm_dtype_size(dtype), peer);
}

}  // namespace

MpiCommunicator::MpiCommunicator(std::shared_ptr<CommThread> thread,
                                 std::shared_ptr<FlightRecorder> flight, MPI_Comm comm,
                                 std::string name, MemoryTracker& tracker)
    : thread_(std::move(thread)),
      flight_(std::move(flight)),
      comm_(comm),
      name_(std::move(name)),
      tracker_(tracker) {
  CommIdentity identity;
  thread_->run([&] {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // The members' world ranks, so a hang report can name who has not arrived.
    MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> local(static_cast<size_t>(size_));
    identity.members.assign(static_cast<size_t>(size_), -1);
    for (int r = 0; r < size_; ++r) local[static_cast<size_t>(r)] = r;
    MPI_Group_translate_ranks(group, size_, local.data(), world, identity.members.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world);
  });
  identity.name = name_;
  identity.rank = rank_;
  trace_group_ = trace::quote(fmt::format("{}[{}]", name_, fmt::join(identity.members, ",")));
  flight_comm_ = flight_->add_comm(std::move(identity));
}

MpiCommunicator::~MpiCommunicator() {
  // Queued after every pending call, so those finish first.
  thread_->run([&] { MPI_Comm_free(&comm_); });
}

// Timeline trace (util/trace.h): the issue as an instant on the calling
// thread, the execution as a span on the communication thread (a send_recv
// batch, which may overlap later calls, as an asynchronous span).
std::string MpiCommunicator::trace_args(const CallRecord& record) const {
  return fmt::format(R"("group":{},"seq":{},"bytes":{},"peer":{},"dtype":"{}")", trace_group_,
                     record.seq, record.bytes, record.peer, comm_dtype_name(record.dtype));
}

void MpiCommunicator::trace_issue(const CallRecord& record) const {
  trace::instant("comm issue", std::string(comm_op_name(record.op)), trace_args(record));
}

void MpiCommunicator::trace_execution(const CallRecord& record, uint64_t flight_id) const {
  std::string name(comm_op_name(record.op));
  if (record.op == CommOp::send_recv) {
    trace::async_span("p2p", std::move(name), flight_id, record.started, record.finished,
                      trace_args(record));
  } else {
    trace::complete("comm", std::move(name), record.started, record.finished, trace_args(record));
  }
}

Work MpiCommunicator::submit(CallRecord record, std::function<void()> fn) {
  auto state = std::make_shared<MpiWork>(*thread_);
  std::lock_guard lock(submit_mutex_);
  record.seq = next_seq_.fetch_add(1);
  record.submitted = CommClock::now();
  const uint64_t flight_id = flight_->issue(flight_comm_, record);
  if (trace::enabled()) trace_issue(record);
  thread_->post([this, state, record, flight_id, fn = std::move(fn)]() mutable {
    std::exception_ptr error;
    record.started = CommClock::now();
    flight_->start(flight_id, record.started);
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    record.finished = CommClock::now();
    flight_->finish(flight_id, record, error != nullptr);
    trace_.record(record);
    if (trace::enabled()) trace_execution(record, flight_id);
    state->complete(record, std::move(error));
  });
  return Work(state, record.seq);
}

void MpiCommunicator::reduce_scatter_call(const void* send, void* recv,
                                          const std::vector<int>& counts, MPI_Datatype type,
                                          ReduceOp op, bool even) {
  const int mine = counts[static_cast<size_t>(rank_)];
  int size_of_type = 0;
  MPI_Type_size(type, &size_of_type);
  size_t total = 0;
  for (int c : counts) total += static_cast<size_t>(c);
  collective(*thread_, comm_, total * static_cast<size_t>(size_of_type), name_,
             "MPI_Reduce_scatter", [&] {
               return even ? MPI_Reduce_scatter_block(send, recv, mine, type, mpi_op(op), comm_)
                           : MPI_Reduce_scatter(send, recv, counts.data(), type, mpi_op(op), comm_);
             });
}

float* MpiCommunicator::scratch(size_t floats) {
  if (!scratch_.defined() || static_cast<size_t>(scratch_.numel()) < floats) {
    scratch_ = Tensor();
    scratch_ = Tensor({static_cast<int64_t>(std::max<size_t>(floats, 1))}, DType::f32,
                      MemCategory::comm, tracker_);
  }
  return scratch_.data<float>();
}

Work MpiCommunicator::all_reduce_async(void* data, int64_t count, CommDType dtype, ReduceOp op) {
  MESHTRAIN_CHECK(count >= 0, "comm {}: all_reduce: negative count {}", name_, count);
  check_reduce(*this, "all_reduce", dtype, op);
  CallRecord rec =
      call_record(CommOp::all_reduce, dtype, static_cast<size_t>(count) * comm_dtype_size(dtype));
  return submit(rec, [=, this] {
    const bool via_f32 = dtype == CommDType::bf16;
    const CommDType wire = via_f32 ? CommDType::f32 : dtype;
    for (int64_t begin = 0; begin < count; begin += kMaxChunk) {
      const int64_t n = std::min(kMaxChunk, count - begin);
      void* part = static_cast<char*>(data) + begin * static_cast<int64_t>(comm_dtype_size(dtype));
      void* buf = part;
      if (via_f32) {
        float* f = scratch(static_cast<size_t>(n));
        bf16_to_f32(part, f, n);
        buf = f;
      }
      const int in = static_cast<int>(n);
      collective(
          *thread_, comm_, static_cast<size_t>(n) * comm_dtype_size(dtype), name_, "MPI_Allreduce",
          [&] { return MPI_Allreduce(MPI_IN_PLACE, buf, in, mpi_type(wire), mpi_op(op), comm_); });
      if (op == ReduceOp::avg) {
        if (wire == CommDType::f64) {
          divide<double>(buf, n, size_);
        } else {
          divide<float>(buf, n, size_);
        }
      }
      if (via_f32) f32_to_bf16(static_cast<float*>(buf), part, n);
    }
  });
}

Work MpiCommunicator::reduce_scatter_async(const void* send, void* recv,
                                           std::span<const int64_t> counts, CommDType dtype,
                                           ReduceOp op) {
  check_counts(*this, "reduce_scatter", counts);
  check_reduce(*this, "reduce_scatter", dtype, op);
  const int64_t total = sum_of(counts);
  check_int_range(*this, "reduce_scatter", total);
  std::vector<int> icounts(counts.begin(), counts.end());
  const bool even = all_equal(counts);  // MPI's _block variant has the faster algorithms
  CallRecord rec = call_record(CommOp::reduce_scatter, dtype,
                               static_cast<size_t>(total) * comm_dtype_size(dtype));
  return submit(rec, [=, this, icounts = std::move(icounts)] {
    const int64_t mine = icounts[static_cast<size_t>(rank_)];
    if (dtype == CommDType::bf16) {
      float* in = scratch(static_cast<size_t>(total + mine));
      float* out = in + total;
      bf16_to_f32(send, in, total);
      reduce_scatter_call(in, out, icounts, MPI_FLOAT, op, even);
      if (op == ReduceOp::avg) divide<float>(out, mine, size_);
      f32_to_bf16(out, recv, mine);
      return;
    }
    reduce_scatter_call(send, recv, icounts, mpi_type(dtype), op, even);
    if (op == ReduceOp::avg) {
      if (dtype == CommDType::f64) {
        divide<double>(recv, mine, size_);
      } else {
        divide<float>(recv, mine, size_);
      }
    }
  });
}

Work MpiCommunicator::all_gather_async(const void* send, void* recv,
                                       std::span<const int64_t> counts, CommDType dtype) {
  check_counts(*this, "all_gather", counts);
  const int64_t total = sum_of(counts);
  check_int_range(*this, "all_gather", total);
  std::vector<int> icounts(counts.begin(), counts.end()), displs(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + icounts[r - 1];
  const size_t elem = comm_dtype_size(dtype);
  const bool even = all_equal(counts);
  const bool in_place = send == static_cast<const char*>(recv) +
                                    static_cast<size_t>(displs[static_cast<size_t>(rank_)]) * elem;
  CallRecord rec = call_record(CommOp::all_gather, dtype, static_cast<size_t>(total) * elem);
  return submit(rec, [=, this, icounts = std::move(icounts), displs = std::move(displs)] {
    const MPI_Datatype t = mpi_type(dtype);
    const int mine = icounts[static_cast<size_t>(rank_)];
    const void* src = in_place ? MPI_IN_PLACE : send;
    collective(*thread_, comm_, static_cast<size_t>(total) * elem, name_, "MPI_Allgather", [&] {
      return even ? MPI_Allgather(src, mine, t, recv, mine, t, comm_)
                  : MPI_Allgatherv(src, mine, t, recv, icounts.data(), displs.data(), t, comm_);
    });
  });
}

Work MpiCommunicator::broadcast_async(void* data, int64_t count, CommDType dtype, int root) {
  MESHTRAIN_CHECK(count >= 0, "comm {}: broadcast: negative count {}", name_, count);
  check_peer(*this, "broadcast", root, "root");
  CallRecord rec = call_record(CommOp::broadcast, dtype,
                               static_cast<size_t>(count) * comm_dtype_size(dtype), root);
  return submit(rec, [=, this] {
    const int64_t elem = static_cast<int64_t>(comm_dtype_size(dtype));
    for (int64_t begin = 0; begin < count; begin += kMaxChunk) {
      const int64_t n = std::min(kMaxChunk, count - begin);
      void* part = static_cast<char*>(data) + begin * elem;
      const int in = static_cast<int>(n);
      collective(*thread_, comm_, static_cast<size_t>(n * elem), name_, "MPI_Bcast",
                 [&] { return MPI_Bcast(part, in, mpi_type(dtype), root, comm_); });
    }
  });
}

// Nonblocking (MPI_Ialltoallv) and awaited like send/recv: the totals differ
// between ranks, so the handshake of `collective` (decided by size, the same
// on every rank) cannot apply.
Work MpiCommunicator::all_to_all_async(const void* send, std::span<const int64_t> send_counts,
                                       void* recv, std::span<const int64_t> recv_counts,
                                       CommDType dtype) {
  check_counts(*this, "all_to_all (send)", send_counts);
  check_counts(*this, "all_to_all (recv)", recv_counts);
  const int64_t sent = sum_of(send_counts);
  check_int_range(*this, "all_to_all", sent);
  check_int_range(*this, "all_to_all", sum_of(recv_counts));
  auto displacements = [](const std::vector<int>& counts) {
    std::vector<int> displs(counts.size(), 0);
    for (size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
    return displs;
  };
  std::vector<int> scounts(send_counts.begin(), send_counts.end());
  std::vector<int> rcounts(recv_counts.begin(), recv_counts.end());
  std::vector<int> sdispls = displacements(scounts), rdispls = displacements(rcounts);
  CallRecord rec =
      call_record(CommOp::all_to_all, dtype, static_cast<size_t>(sent) * comm_dtype_size(dtype));
  return submit(rec, [=, this, scounts = std::move(scounts), rcounts = std::move(rcounts),
                      sdispls = std::move(sdispls), rdispls = std::move(rdispls)] {
    const MPI_Datatype t = mpi_type(dtype);
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Ialltoallv(send, scounts.data(), sdispls.data(), t, recv, rcounts.data(),
                             rdispls.data(), t, comm_, &request),
              name_, "MPI_Ialltoallv");
    await_request(*thread_, request, name_, "MPI_Ialltoallv");
  });
}

Work MpiCommunicator::send_async(const void* data, int64_t count, CommDType dtype, int peer,
                                 int tag) {
  return submit(p2p_record(*this, CommOp::send, count, dtype, peer), [=, this] {
    const int n = static_cast<int>(count);
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Isend(data, n, mpi_type(dtype), peer, tag, comm_, &request), name_, "MPI_Isend");
    await_request(*thread_, request, name_, "MPI_Isend");
  });
}

Work MpiCommunicator::recv_async(void* data, int64_t count, CommDType dtype, int peer, int tag) {
  return submit(p2p_record(*this, CommOp::recv, count, dtype, peer), [=, this] {
    const int n = static_cast<int>(count);
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Irecv(data, n, mpi_type(dtype), peer, tag, comm_, &request), name_, "MPI_Irecv");
    MPI_Status status = await_request(*thread_, request, name_, "MPI_Irecv");
    int got = 0;
    MPI_Get_count(&status, mpi_type(dtype), &got);
    MESHTRAIN_CHECK(got == count, "comm {}: recv from rank {}: got {} elements, expected {}", name_,
                    peer, got, count);
  });
}

// Unlike the other calls, a batch does not hold up the calls issued after it:
// its requests stay posted (CommThread::Outstanding) while the thread runs
// them, so a pipeline stage's pending send never delays its next receive or a
// tensor-parallel collective.
Work MpiCommunicator::send_recv_async(std::vector<P2POp> ops) {
  MESHTRAIN_CHECK(!ops.empty(), "comm {}: send_recv: no transfers", name_);
  size_t bytes = 0;
  for (const P2POp& op : ops) {
    bytes += p2p_record(*this, op.send ? CommOp::send : CommOp::recv, op.count, op.dtype, op.peer)
                 .bytes;
  }
  CallRecord rec = call_record(CommOp::send_recv, ops[0].dtype, bytes, ops[0].peer);
  auto state = std::make_shared<MpiWork>(*thread_);
  std::lock_guard lock(submit_mutex_);
  rec.seq = next_seq_.fetch_add(1);
  rec.submitted = CommClock::now();
  const uint64_t flight_id = flight_->issue(flight_comm_, rec);
  if (trace::enabled()) trace_issue(rec);
  thread_->post([this, state, rec, flight_id, ops = std::move(ops)]() mutable {
    rec.started = CommClock::now();
    flight_->start(flight_id, rec.started);
    auto finish = [this, state, flight_id](CallRecord record, std::exception_ptr error) {
      record.finished = CommClock::now();
      flight_->finish(flight_id, record, error != nullptr);
      trace_.record(record);
      if (trace::enabled()) trace_execution(record, flight_id);
      state->complete(record, std::move(error));
    };
    CommThread::Outstanding o;
    o.requests.assign(ops.size(), MPI_REQUEST_NULL);
    try {
      for (size_t i = 0; i < ops.size(); ++i) {
        const P2POp& op = ops[i];
        const int n = static_cast<int>(op.count);
        if (op.send) {
          check_mpi(MPI_Isend(op.data, n, mpi_type(op.dtype), op.peer, op.tag, comm_, &o.requests[i]),
                    name_, "MPI_Isend");
        } else {
          check_mpi(MPI_Irecv(op.data, n, mpi_type(op.dtype), op.peer, op.tag, comm_, &o.requests[i]),
                    name_, "MPI_Irecv");
        }
      }
    } catch (...) {
      finish(rec, std::current_exception());
      return;
    }
    o.done = [this, finish, rec, ops](const std::vector<MPI_Status>& statuses, int rc) {
      std::exception_ptr error;
      try {
        check_mpi(rc, name_, "send_recv (MPI_Testall)");
        for (size_t i = 0; i < ops.size(); ++i) {
          if (ops[i].send) continue;
          int got = 0;
          MPI_Get_count(&statuses[i], mpi_type(ops[i].dtype), &got);
          MESHTRAIN_CHECK(got == ops[i].count,
                          "comm {}: send_recv: recv from rank {}: got {} elements, expected {}",
                          name_, ops[i].peer, got, ops[i].count);
        }
      } catch (...) {
        error = std::current_exception();
      }
      finish(rec, error);
    };
    thread_->add_outstanding(std::move(o));
  });
  return Work(state, rec.seq);
}

Work MpiCommunicator::barrier_async() {
  return submit(call_record(CommOp::barrier, CommDType::f32, 0), [this] {
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibarrier(comm_, &request), name_, "MPI_Ibarrier");
    await_request(*thread_, request, name_, "MPI_Ibarrier");
  });
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, std::string name) {
  MESHTRAIN_CHECK(color >= 0, "comm {}: split: color must be >= 0, got {}", name_, color);
  MPI_Comm sub = MPI_COMM_NULL;
  thread_->run(
      [&] { check_mpi(MPI_Comm_split(comm_, color, key, &sub), name_, "MPI_Comm_split"); });
  return std::unique_ptr<Communicator>(
      new MpiCommunicator(thread_, flight_, sub, std::move(name), tracker_));
}

void MpiCommunicator::run_raw(const std::function<void(MPI_Comm)>& fn) {
  thread_->run([&] { fn(comm_); });
}

MpiEnvironment::MpiEnvironment() {
  int initialised = 0;
  MPI_Initialized(&initialised);
  MESHTRAIN_CHECK(!initialised,
                  "MPI: already initialised in this process (one MpiEnvironment per process)");
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    fail(
        "MPI: the library provides thread level {} but meshtrain needs MPI_THREAD_SERIALIZED ({}): "
        "all MPI calls run on a communication thread",
        provided, MPI_THREAD_SERIALIZED);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
  MPI_Comm local = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank_, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &local_rank_);
  MPI_Comm_size(local, &local_size_);
  MPI_Comm_free(&local);
  // From here on, MPI is called from the communication thread only.
  thread_ = std::make_shared<CommThread>();
}

MpiEnvironment::~MpiEnvironment() {
  if (thread_.use_count() != 1) {
    std::fprintf(stderr, "meshtrain: MPI: a communicator outlives the MpiEnvironment\n");
  }
  thread_.reset();  // joins
  MPI_Finalize();
}

std::unique_ptr<MpiCommunicator> MpiEnvironment::world(MemoryTracker& tracker, std::string name) {
  MPI_Comm dup = MPI_COMM_NULL;
  thread_->run([&] { check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "world", "MPI_Comm_dup"); });
  return std::unique_ptr<MpiCommunicator>(
      new MpiCommunicator(thread_, flight_, dup, std::move(name), tracker));
}

void MpiEnvironment::abort(int exit_code) {
  // Called from a failing thread while the communication thread may be inside
  // a call that will never complete: the job ends regardless.
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

int default_threads_per_rank(int local_ranks, int available_cores) {
  const int node = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int share = std::max(1, node / std::max(1, local_ranks));
  return std::max(1, std::min(share, available_cores));
}

}  // namespace meshtrain
