#include "meshtrain/comm/nccl/nccl.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "meshtrain/backend/cuda/kernels.h"
#include "meshtrain/backend/cuda/library.h"
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {
namespace {

NcclApi load_nccl() {
  constexpr const char* what = "NCCL";
  void* library = cuda::open_library(what, "MESHTRAIN_NCCL", "libnccl.so.2");
  NcclApi api{};
  cuda::bind(library, what, "ncclGetVersion", api.get_version);
  cuda::bind(library, what, "ncclGetUniqueId", api.get_unique_id);
  cuda::bind(library, what, "ncclCommInitRank", api.init_rank);
  cuda::bind(library, what, "ncclCommSplit", api.split);
  cuda::bind(library, what, "ncclCommDestroy", api.destroy);
  cuda::bind(library, what, "ncclCommAbort", api.abort);
  cuda::bind(library, what, "ncclCommGetAsyncError", api.async_error);
  cuda::bind(library, what, "ncclGetErrorString", api.error_string);
  cuda::bind(library, what, "ncclGetLastError", api.last_error);
  cuda::bind(library, what, "ncclAllReduce", api.all_reduce);
  cuda::bind(library, what, "ncclReduceScatter", api.reduce_scatter);
  cuda::bind(library, what, "ncclAllGather", api.all_gather);
  cuda::bind(library, what, "ncclBroadcast", api.broadcast);
  cuda::bind(library, what, "ncclReduce", api.reduce);
  cuda::bind(library, what, "ncclSend", api.send);
  cuda::bind(library, what, "ncclRecv", api.recv);
  cuda::bind(library, what, "ncclGroupStart", api.group_start);
  cuda::bind(library, what, "ncclGroupEnd", api.group_end);
  return api;  // the library stays loaded for the process
}

ncclDataType_t nccl_type(CommDType dtype) {
  switch (dtype) {
    case CommDType::f32: return ncclFloat32;
    case CommDType::bf16: return ncclBfloat16;
    case CommDType::f64: return ncclFloat64;
    case CommDType::i32: return ncclInt32;
    case CommDType::i64: return ncclInt64;
    case CommDType::f16: return ncclFloat16;
  }
  fail("nccl: unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  fail("nccl: unknown reduction");
}

const char* at(const void* base, int64_t elements, size_t element_bytes) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(element_bytes);
}
char* at(void* base, int64_t elements, size_t element_bytes) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(element_bytes);
}

// Every live communicator, for abort_nccl_communicators().
std::mutex registry_mutex;
std::vector<NcclCommunicator*>& registry() {
  static std::vector<NcclCommunicator*> live;
  return live;
}

}  // namespace

const NcclApi& nccl_api() {
  static std::once_flag once;
  static NcclApi api{};
  std::call_once(once, [] { api = load_nccl(); });
  return api;
}

std::string nccl_version() {
  int v = 0;
  nccl_api().get_version(&v);
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

NcclId nccl_unique_id() {
  const NcclApi& api = nccl_api();
  ncclUniqueId uid;
  const ncclResult_t result = api.get_unique_id(&uid);
  MESHTRAIN_CHECK_AS(ErrorKind::resource, result == ncclSuccess, "nccl: ncclGetUniqueId: {}: {}",
                     api.error_string(result), api.last_error(nullptr));
  NcclId id;
  static_assert(sizeof(uid) == sizeof(id.bytes));
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

NcclId share_nccl_id(Communicator& bootstrap) {
  static_assert(NCCL_UNIQUE_ID_BYTES % sizeof(int32_t) == 0);
  NcclId id;
  if (bootstrap.rank() == 0) id = nccl_unique_id();
  bootstrap.broadcast(id.bytes.data(), NCCL_UNIQUE_ID_BYTES / sizeof(int32_t), CommDType::i32, 0);
  return id;
}

// One issued call: its completion event and the Work state a caller waits on.
// The event lives as long as the call (the progress thread may still query it
// while an abort completes the call on another thread).
struct NcclCommunicator::Pending final : Work::State {
  ~Pending() override {
    if (done != nullptr) cudaEventDestroy(done);
  }
  uint64_t flight_id = 0;
  cudaEvent_t done = nullptr;
  mutable std::mutex mutex;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr error;
  CallRecord call;

  void wait() override {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return finished; });
    if (error) std::rethrow_exception(error);
  }
  bool test() override {
    std::lock_guard lock(mutex);
    return finished;
  }
  CallRecord record() const override {
    std::lock_guard lock(mutex);
    return call;
  }
};

// f32 device scratch for bf16 reductions, stream-ordered on the communication
// stream (a call still running on the old block finishes before it is freed).
class NcclCommunicator::Scratch {
 public:
  explicit Scratch(MemoryTracker* tracker) : tracker_(tracker) {}
  ~Scratch() {
    if (data_ != nullptr) cudaFree(data_);
    if (tracker_ != nullptr && bytes_ > 0) tracker_->on_free(MemCategory::comm, bytes_);
  }
  float* reserve(size_t floats, cudaStream_t stream) {
    const size_t bytes = std::max<size_t>(floats, 1) * sizeof(float);
    if (bytes <= bytes_) return data_;
    if (data_ != nullptr) {
      cuda::check(cudaFreeAsync(data_, stream), "cudaFreeAsync (nccl scratch)");
      if (tracker_ != nullptr) tracker_->on_free(MemCategory::comm, bytes_);
    }
    void* block = nullptr;
    cuda::check(cudaMallocAsync(&block, bytes, stream), "cudaMallocAsync (nccl scratch)");
    data_ = static_cast<float*>(block);
    bytes_ = bytes;
    if (tracker_ != nullptr) tracker_->on_alloc(MemCategory::comm, bytes_);
    return data_;
  }
  int32_t* flag(cudaStream_t stream) { return reinterpret_cast<int32_t*>(reserve(1, stream)); }

 private:
  MemoryTracker* tracker_;
  float* data_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(const NcclId& id, int rank, int size,
                                                           std::string name, Options options) {
  const NcclApi& api = nccl_api();
  MESHTRAIN_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl {}: rank {} of {}", name, rank,
                  size);
  cuda::check(cudaSetDevice(options.device), "cudaSetDevice");
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  ncclComm_t comm = nullptr;
  const ncclResult_t result = api.init_rank(&comm, size, uid, rank);
  MESHTRAIN_CHECK_AS(ErrorKind::resource, result == ncclSuccess,
                     "nccl {}: ncclCommInitRank (rank {} of {}, device {}): {}: {}", name, rank,
                     size, options.device, api.error_string(result), api.last_error(comm));
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, rank, size, std::move(name), std::move(options)));
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int rank, int size, std::string name,
                                   Options options)
    : comm_(comm), rank_(rank), size_(size), name_(std::move(name)), options_(std::move(options)) {
  if (options_.world_ranks.empty()) {
    options_.world_ranks.resize(static_cast<size_t>(size_));
    std::iota(options_.world_ranks.begin(), options_.world_ranks.end(), 0);
  }
  MESHTRAIN_CHECK(options_.world_ranks.size() == static_cast<size_t>(size_),
                  "nccl {}: {} world ranks for {} members", name_, options_.world_ranks.size(), size_);
  cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda::check(cudaStreamCreateWithFlags(&p2p_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda::check(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming), "cudaEventCreate");
  scratch_ = std::make_unique<Scratch>(options_.tracker);
  if (options_.flight != nullptr) {
    flight_comm_ = options_.flight->add_comm({name_, options_.world_ranks, rank_});
  }
  {
    std::lock_guard lock(registry_mutex);
    registry().push_back(this);
  }
  progress_ = std::thread([this] { progress(); });
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard lock(registry_mutex);
    std::erase(registry(), this);
  }
  {
    std::lock_guard lock(pending_mutex_);
    stop_ = true;
  }
  pending_cv_.notify_all();
  progress_.join();  // after every pending call completed or failed
  {
    std::lock_guard lock(comm_mutex_);
    if (!aborted_) nccl_api().destroy(comm_);
  }
  cudaStreamSynchronize(stream_);
  scratch_.reset();
  cudaEventDestroy(compute_done_);
  cudaStreamDestroy(p2p_stream_);
  cudaStreamDestroy(stream_);
}

void NcclCommunicator::check(ncclResult_t result, const char* call) const {
  if (result == ncclSuccess || result == ncclInProgress) return;
  const NcclApi& api = nccl_api();
  fail_as(result == ncclSystemError || result == ncclRemoteError ? ErrorKind::peer
                                                                 : ErrorKind::resource,
          "nccl {}: {}: {}: {}", name_, call, api.error_string(result), api.last_error(comm_));
}

Work NcclCommunicator::submit(CallRecord record, bool p2p,
                              const std::function<void(cudaStream_t)>& enqueue) {
  auto pending = std::make_shared<Pending>();
  std::lock_guard lock(submit_mutex_);
  MESHTRAIN_CHECK_AS(ErrorKind::peer, !aborted_, "nccl {}: {} after the communicator was aborted",
                     name_, comm_op_name(record.op));
  record.seq = next_seq_.fetch_add(1);
  record.submitted = CommClock::now();
  FlightRecorder* flight = options_.flight;
  pending->flight_id = flight != nullptr ? flight->issue(flight_comm_, record) : 0;
  const cudaStream_t stream = p2p ? p2p_stream_ : stream_;
  try {
    cuda::check(cudaSetDevice(options_.device), "cudaSetDevice");
    cuda::check(cudaEventRecord(compute_done_, options_.compute), "cudaEventRecord");
    cuda::check(cudaStreamWaitEvent(stream, compute_done_, 0), "cudaStreamWaitEvent");
    enqueue(stream);
    cuda::check(cudaEventCreateWithFlags(&pending->done, cudaEventDisableTiming), "cudaEventCreate");
    cuda::check(cudaEventRecord(pending->done, stream), "cudaEventRecord");
  } catch (...) {
    record.started = record.finished = CommClock::now();
    if (flight != nullptr) flight->finish(pending->flight_id, record, true);
    throw;
  }
  // The stream runs the call once what precedes it has: the deadline counts
  // from now, and a call behind a stuck one is not the first past its deadline.
  record.started = CommClock::now();
  if (flight != nullptr) flight->start(pending->flight_id, record.started);
  pending->call = record;
  {
    std::lock_guard queue(pending_mutex_);
    pending_.push_back(pending);
  }
  pending_cv_.notify_all();
  return Work(pending, record.seq);
}

void NcclCommunicator::progress() {
  cudaSetDevice(options_.device);
  const NcclApi& api = nccl_api();
  for (;;) {
    std::vector<std::shared_ptr<Pending>> calls;
    {
      std::unique_lock lock(pending_mutex_);
      pending_cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stop_ and nothing left
      calls.assign(pending_.begin(), pending_.end());
    }
    bool progressed = false;
    for (const std::shared_ptr<Pending>& p : calls) {
      const cudaError_t status = cudaEventQuery(p->done);
      if (status == cudaErrorNotReady) continue;
      std::exception_ptr error;
      if (status != cudaSuccess) {
        error = std::make_exception_ptr(
            Error(fmt::format("nccl {}: {} #{}: {}", name_, comm_op_name(p->call.op), p->call.seq,
                              cudaGetErrorString(status)),
                  ErrorKind::resource));
      }
      finish(p, error);
      progressed = true;
    }
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard lock(comm_mutex_);
      if (!aborted_) api.async_error(comm_, &async);
    }
    if (async != ncclSuccess && async != ncclInProgress) {
      abort_with(fmt::format("asynchronous error: {}: {}", api.error_string(async),
                             api.last_error(comm_)));
      continue;
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclCommunicator::finish(const std::shared_ptr<Pending>& p, std::exception_ptr error) {
  {
    std::lock_guard lock(pending_mutex_);
    const auto it = std::find(pending_.begin(), pending_.end(), p);
    if (it == pending_.end()) return;  // already finished (aborted meanwhile)
    pending_.erase(it);
  }
  CallRecord call;
  {
    std::lock_guard lock(p->mutex);
    p->call.finished = CommClock::now();
    call = p->call;
  }
  if (options_.flight != nullptr) options_.flight->finish(p->flight_id, call, error != nullptr);
  trace_.record(call);
  if (trace::enabled()) {
    const std::string args = fmt::format("\"comm\":{},\"seq\":{},\"bytes\":{}", trace::quote(name_),
                                         call.seq, call.bytes);
    if (call.op == CommOp::send_recv) {
      trace::async_span("p2p", std::string(comm_op_name(call.op)), p->flight_id, call.started,
                        call.finished, args);
    } else {
      trace::complete("comm", std::string(comm_op_name(call.op)), call.started, call.finished,
                      args);
    }
  }
  {
    std::lock_guard lock(p->mutex);
    p->error = std::move(error);
    p->finished = true;
  }
  p->cv.notify_all();
}

void NcclCommunicator::abort_with(const std::string& why) {
  {
    std::lock_guard lock(comm_mutex_);
    if (!aborted_.exchange(true)) nccl_api().abort(comm_);
  }
  std::vector<std::shared_ptr<Pending>> calls;
  {
    std::lock_guard lock(pending_mutex_);
    calls.assign(pending_.begin(), pending_.end());
  }
  for (const std::shared_ptr<Pending>& p : calls) {
    finish(p, std::make_exception_ptr(Error(fmt::format("nccl {}: {} #{}: {}", name_,
                                                        comm_op_name(p->call.op), p->call.seq, why),
                                            ErrorKind::peer)));
  }
}

void NcclCommunicator::abort() { abort_with("the communicator was aborted"); }

float* NcclCommunicator::widen(const void* bf16, int64_t n, int64_t capacity, cudaStream_t stream) {
  float* f32 = scratch_->reserve(static_cast<size_t>(capacity), stream);
  cuda::launch_convert(stream, cuda::Elem::bf16, bf16, cuda::Elem::f32, f32, n);
  return f32;
}

Work NcclCommunicator::all_reduce_async(void* data, int64_t count, CommDType dtype, ReduceOp op) {
  MESHTRAIN_CHECK(count >= 0, "comm {}: all_reduce: negative count {}", name_, count);
  check_reduce(*this, "all_reduce", dtype, op);
  const CallRecord rec =
      call_record(CommOp::all_reduce, dtype, static_cast<size_t>(count) * comm_dtype_size(dtype));
  return submit(rec, false, [=, this](cudaStream_t s) {
    if (count == 0) return;
    const NcclApi& api = nccl_api();
    if (dtype != CommDType::bf16) {
      check(api.all_reduce(data, data, static_cast<size_t>(count), nccl_type(dtype), nccl_op(op),
                           comm_, s),
            "ncclAllReduce");
      return;
    }
    float* f32 = widen(data, count, count, s);
    check(api.all_reduce(f32, f32, static_cast<size_t>(count), ncclFloat32, nccl_op(op), comm_, s),
          "ncclAllReduce");
    cuda::launch_convert(s, cuda::Elem::f32, f32, cuda::Elem::bf16, data, count);
  });
}

Work NcclCommunicator::reduce_scatter_async(const void* send, void* recv,
                                            std::span<const int64_t> counts, CommDType dtype,
                                            ReduceOp op) {
  check_counts(*this, "reduce_scatter", counts);
  check_reduce(*this, "reduce_scatter", dtype, op);
  const int64_t total = sum_of(counts), mine = counts[static_cast<size_t>(rank_)];
  const bool even = all_equal(counts);
  std::vector<int64_t> parts(counts.begin(), counts.end());
  const CallRecord rec =
      call_record(CommOp::reduce_scatter, dtype, static_cast<size_t>(total) * comm_dtype_size(dtype));
  return submit(rec, false, [=, this, parts = std::move(parts)](cudaStream_t s) {
    if (total == 0) return;
    const NcclApi& api = nccl_api();
    const bool via_f32 = dtype == CommDType::bf16;
    const ncclDataType_t type = via_f32 ? ncclFloat32 : nccl_type(dtype);
    const size_t element = via_f32 ? sizeof(float) : comm_dtype_size(dtype);
    const void* in = send;
    void* out = recv;
    if (via_f32) {
      float* f32 = widen(send, total, total + mine, s);
      in = f32;
      out = f32 + total;
    }
    if (even) {
      check(api.reduce_scatter(in, out, static_cast<size_t>(mine), type, nccl_op(op), comm_, s),
            "ncclReduceScatter");
    } else {
      check(api.group_start(), "ncclGroupStart");
      int64_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        const int64_t n = parts[static_cast<size_t>(r)];
        check(api.reduce(at(in, offset, element), out, static_cast<size_t>(n), type, nccl_op(op), r,
                         comm_, s),
              "ncclReduce");
        offset += n;
      }
      check(api.group_end(), "ncclGroupEnd");
    }
    if (via_f32) cuda::launch_convert(s, cuda::Elem::f32, out, cuda::Elem::bf16, recv, mine);
  });
}

Work NcclCommunicator::all_gather_async(const void* send, void* recv,
                                        std::span<const int64_t> counts, CommDType dtype) {
  check_counts(*this, "all_gather", counts);
  const int64_t total = sum_of(counts);
  const bool even = all_equal(counts);
  std::vector<int64_t> parts(counts.begin(), counts.end());
  const CallRecord rec =
      call_record(CommOp::all_gather, dtype, static_cast<size_t>(total) * comm_dtype_size(dtype));
  return submit(rec, false, [=, this, parts = std::move(parts)](cudaStream_t s) {
    if (total == 0) return;
    const NcclApi& api = nccl_api();
    const ncclDataType_t type = nccl_type(dtype);
    const size_t element = comm_dtype_size(dtype);
    if (even) {
      check(api.all_gather(send, recv, static_cast<size_t>(parts[0]), type, comm_, s),
            "ncclAllGather");
      return;
    }
    check(api.group_start(), "ncclGroupStart");
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t n = parts[static_cast<size_t>(r)];
      check(api.broadcast(send, at(recv, offset, element), static_cast<size_t>(n), type, r, comm_, s),
            "ncclBroadcast");
      offset += n;
    }
    check(api.group_end(), "ncclGroupEnd");
  });
}

Work NcclCommunicator::broadcast_async(void* data, int64_t count, CommDType dtype, int root) {
  check_peer(*this, "broadcast", root, "root");
  MESHTRAIN_CHECK(count >= 0, "comm {}: broadcast: negative count {}", name_, count);
  const CallRecord rec = call_record(CommOp::broadcast, dtype,
                                     static_cast<size_t>(count) * comm_dtype_size(dtype), root);
  return submit(rec, false, [=, this](cudaStream_t s) {
    if (count == 0) return;
    check(nccl_api().broadcast(data, data, static_cast<size_t>(count), nccl_type(dtype), root, comm_,
                               s),
          "ncclBroadcast");
  });
}

Work NcclCommunicator::all_to_all_async(const void* send, std::span<const int64_t> send_counts,
                                        void* recv, std::span<const int64_t> recv_counts,
                                        CommDType dtype) {
  check_counts(*this, "all_to_all", send_counts);
  check_counts(*this, "all_to_all", recv_counts);
  std::vector<int64_t> out(send_counts.begin(), send_counts.end());
  std::vector<int64_t> in(recv_counts.begin(), recv_counts.end());
  const CallRecord rec = call_record(CommOp::all_to_all, dtype,
                                     static_cast<size_t>(sum_of(send_counts)) * comm_dtype_size(dtype));
  return submit(rec, false, [=, this, out = std::move(out), in = std::move(in)](cudaStream_t s) {
    const NcclApi& api = nccl_api();
    const ncclDataType_t type = nccl_type(dtype);
    const size_t element = comm_dtype_size(dtype);
    check(api.group_start(), "ncclGroupStart");
    int64_t sent = 0, received = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t n_out = out[static_cast<size_t>(r)], n_in = in[static_cast<size_t>(r)];
      if (n_out > 0) {
        check(api.send(at(send, sent, element), static_cast<size_t>(n_out), type, r, comm_, s),
              "ncclSend");
      }
      if (n_in > 0) {
        check(api.recv(at(recv, received, element), static_cast<size_t>(n_in), type, r, comm_, s),
              "ncclRecv");
      }
      sent += n_out;
      received += n_in;
    }
    check(api.group_end(), "ncclGroupEnd");
  });
}

Work NcclCommunicator::send_async(const void* data, int64_t count, CommDType dtype, int peer,
                                  int /*tag*/) {
  check_peer(*this, "send", peer, "peer");
  MESHTRAIN_CHECK(count >= 0, "comm {}: send: negative count {}", name_, count);
  const CallRecord rec =
      call_record(CommOp::send, dtype, static_cast<size_t>(count) * comm_dtype_size(dtype), peer);
  return submit(rec, false, [=, this](cudaStream_t s) {
    check(nccl_api().send(data, static_cast<size_t>(count), nccl_type(dtype), peer, comm_, s),
          "ncclSend");
  });
}

Work NcclCommunicator::recv_async(void* data, int64_t count, CommDType dtype, int peer,
                                  int /*tag*/) {
  check_peer(*this, "recv", peer, "peer");
  MESHTRAIN_CHECK(count >= 0, "comm {}: recv: negative count {}", name_, count);
  const CallRecord rec =
      call_record(CommOp::recv, dtype, static_cast<size_t>(count) * comm_dtype_size(dtype), peer);
  return submit(rec, false, [=, this](cudaStream_t s) {
    check(nccl_api().recv(data, static_cast<size_t>(count), nccl_type(dtype), peer, comm_, s),
          "ncclRecv");
  });
}

Work NcclCommunicator::send_recv_async(std::vector<P2POp> ops) {
  size_t bytes = 0;
  for (const P2POp& op : ops) {
    check_peer(*this, "send_recv", op.peer, "peer");
    MESHTRAIN_CHECK(op.count >= 0, "comm {}: send_recv: negative count {}", name_, op.count);
    bytes += static_cast<size_t>(op.count) * comm_dtype_size(op.dtype);
  }
  const CallRecord rec = call_record(CommOp::send_recv, ops.empty() ? CommDType::f32 : ops[0].dtype,
                                     bytes, ops.empty() ? -1 : ops[0].peer);
  return submit(rec, true, [this, ops = std::move(ops)](cudaStream_t s) {
    const NcclApi& api = nccl_api();
    check(api.group_start(), "ncclGroupStart");
    for (const P2POp& op : ops) {
      const auto n = static_cast<size_t>(op.count);
      if (op.send) {
        check(api.send(op.data, n, nccl_type(op.dtype), op.peer, comm_, s), "ncclSend");
      } else {
        check(api.recv(op.data, n, nccl_type(op.dtype), op.peer, comm_, s), "ncclRecv");
      }
    }
    check(api.group_end(), "ncclGroupEnd");
  });
}

Work NcclCommunicator::barrier_async() {
  const CallRecord rec = call_record(CommOp::barrier, CommDType::i32, 0);
  return submit(rec, false, [this](cudaStream_t s) {
    int32_t* flag = scratch_->flag(s);
    check(nccl_api().all_reduce(flag, flag, 1, ncclInt32, ncclSum, comm_, s), "ncclAllReduce");
  });
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key, std::string name) {
  MESHTRAIN_CHECK(color >= 0, "comm {}: split: color {} must be >= 0", name_, color);
  // Every member's (color, key) first, to know the new group's world ranks.
  const auto n = static_cast<size_t>(size_);
  std::vector<int32_t> mine{color, key}, all(2 * n);
  int32_t* device = nullptr;
  cuda::check(cudaMalloc(&device, 2 * n * sizeof(int32_t)), "cudaMalloc (nccl split)");
  try {
    cuda::check(cudaMemcpy(device + 2 * rank_, mine.data(), 2 * sizeof(int32_t),
                           cudaMemcpyHostToDevice),
                "cudaMemcpy");
    all_gather(device + 2 * rank_, device, 2, CommDType::i32);
    cuda::check(cudaMemcpy(all.data(), device, 2 * n * sizeof(int32_t), cudaMemcpyDeviceToHost),
                "cudaMemcpy");
  } catch (...) {
    cudaFree(device);
    throw;
  }
  cudaFree(device);
  std::vector<int> members;  // old ranks with this color, by (key, old rank)
  for (int r = 0; r < size_; ++r) {
    if (all[2 * static_cast<size_t>(r)] == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return all[2 * static_cast<size_t>(a) + 1] < all[2 * static_cast<size_t>(b) + 1];
  });
  Options options = options_;
  options.world_ranks.clear();
  int new_rank = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    options.world_ranks.push_back(options_.world_ranks[static_cast<size_t>(members[i])]);
    if (members[i] == rank_) new_rank = static_cast<int>(i);
  }
  ncclComm_t comm = nullptr;
  check(nccl_api().split(comm_, color, key, &comm, nullptr), "ncclCommSplit");
  return std::unique_ptr<Communicator>(new NcclCommunicator(
      comm, new_rank, static_cast<int>(members.size()), std::move(name), std::move(options)));
}

int abort_nccl_communicators() {
  std::lock_guard lock(registry_mutex);  // a destructor waits here before it goes on
  for (NcclCommunicator* comm : registry()) comm->abort();
  return static_cast<int>(registry().size());
}

}  // namespace meshtrain
