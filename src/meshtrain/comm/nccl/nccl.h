// A Communicator on NCCL, for buffers in GPU memory (docs/gpu.md, "NCCL").
//
// Contract (communicator.h's, with these specifics):
// - Every buffer a call takes is device memory of the communicator's GPU.
//   Counts, peers and roots are checked on the calling thread, as for MPI.
// - A call is enqueued on the communicator's communication stream behind the
//   work already issued on the compute stream it was given (an event between
//   the two), in issue order. Point-to-point batches (send_recv_async) go on
//   a stream of their own, so a send still waiting for its receiver never
//   holds up the next collective.
// - A progress thread polls each call's completion event and marks it done
//   in the stats, the flight recorder (so the watchdog sees a call that does
//   not finish) and the timeline trace. It also polls ncclCommGetAsyncError:
//   an asynchronous error fails every pending call with an Error of kind
//   peer naming the communicator, the call and NCCL's reason.
// - Work::wait blocks until the call completed, or rethrows its failure.
// - bf16 reductions run in f32, as the contract says: the buffer is widened
//   into a device scratch on the communication stream, reduced, narrowed back.
// - NCCL's reduce-scatter and all-gather take even parts: uneven counts go
//   as one ncclReduce / ncclBroadcast per rank in a group; all-to-all is a
//   group of sends and receives. NCCL has no tags: point-to-point transfers
//   between two ranks match in issue order.
// - abort() ends the NCCL communicator (ncclCommAbort), so no kernel is left
//   spinning on a peer that is gone; abort_nccl_communicators() aborts every
//   live one of the process (what the watchdog's end of job calls first).
// - NCCL refuses two ranks on one GPU: ranks that share a GPU use the MPI
//   communicator with host staging.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/flight_recorder.h"
#include "meshtrain/tensor/memory_tracker.h"

namespace meshtrain {

// The entry points of libnccl.so.2, opened on first use (backend/cuda/library.h:
// $MESHTRAIN_NCCL, the loader's path, then the toolkit's library folder).
struct NcclApi {
  decltype(&ncclGetVersion) get_version;
  decltype(&ncclGetUniqueId) get_unique_id;
  decltype(&ncclCommInitRank) init_rank;
  decltype(&ncclCommSplit) split;
  decltype(&ncclCommDestroy) destroy;
  decltype(&ncclCommAbort) abort;
  decltype(&ncclCommGetAsyncError) async_error;
  decltype(&ncclGetErrorString) error_string;
  decltype(&ncclGetLastError) last_error;
  decltype(&ncclAllReduce) all_reduce;
  decltype(&ncclReduceScatter) reduce_scatter;
  decltype(&ncclAllGather) all_gather;
  decltype(&ncclBroadcast) broadcast;
  decltype(&ncclReduce) reduce;
  decltype(&ncclSend) send;
  decltype(&ncclRecv) recv;
  decltype(&ncclGroupStart) group_start;
  decltype(&ncclGroupEnd) group_end;
};
// Throws Error (resource) naming where it looked.
const NcclApi& nccl_api();
std::string nccl_version();  // "2.28.9"

// The bootstrap of a group: an opaque id one rank makes (no GPU needed) and
// every member passes to create().
struct NcclId {
  std::array<char, NCCL_UNIQUE_ID_BYTES> bytes{};
};
NcclId nccl_unique_id();
// Collective over `bootstrap` (any communicator on host memory, MPI's world):
// rank 0 makes the id and broadcasts it; every member returns the same id.
NcclId share_nccl_id(Communicator& bootstrap);

class NcclCommunicator final : public Communicator {
 public:
  struct Options {
    int device = 0;
    cudaStream_t compute = nullptr;    // calls follow this stream's work (nullptr: the default stream)
    MemoryTracker* tracker = nullptr;  // counts the f32 scratch of bf16 reductions (category comm)
    FlightRecorder* flight = nullptr;  // records every call when given (the watchdog reads it)
    std::vector<int> world_ranks;      // each member's world rank, for the recorder (default 0..size-1)
  };

  // Collective over the `size` processes passing the same id: ncclCommInitRank
  // on options.device. Throws Error (resource) with NCCL's and CUDA's reason
  // when this process cannot use the device.
  static std::unique_ptr<NcclCommunicator> create(const NcclId& id, int rank, int size,
                                                  std::string name, Options options);
  ~NcclCommunicator() override;  // waits for pending calls, then destroys the NCCL communicator

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  Work all_reduce_async(void* data, int64_t count, CommDType dtype, ReduceOp op) override;
  Work reduce_scatter_async(const void* send, void* recv, std::span<const int64_t> counts,
                            CommDType dtype, ReduceOp op) override;
  Work all_gather_async(const void* send, void* recv, std::span<const int64_t> counts,
                        CommDType dtype) override;
  Work broadcast_async(void* data, int64_t count, CommDType dtype, int root) override;
  Work all_to_all_async(const void* send, std::span<const int64_t> send_counts, void* recv,
                        std::span<const int64_t> recv_counts, CommDType dtype) override;
  Work send_async(const void* data, int64_t count, CommDType dtype, int peer, int tag) override;
  Work recv_async(void* data, int64_t count, CommDType dtype, int peer, int tag) override;
  Work send_recv_async(std::vector<P2POp> ops) override;
  Work barrier_async() override;
  std::unique_ptr<Communicator> split(int color, int key, std::string name) override;

  CommStats stats() const override { return trace_.stats(); }
  std::vector<CallRecord> recent_calls() const override { return trace_.recent(); }
  uint64_t calls_issued() const override { return next_seq_; }

  // ncclCommAbort: pending and later calls fail (kind peer). Any thread.
  void abort();

 private:
  struct Pending;
  class Scratch;
  NcclCommunicator(ncclComm_t comm, int rank, int size, std::string name, Options options);
  // Numbers and records the call, orders `stream` after the compute stream,
  // runs enqueue(stream) (the NCCL calls) and hands the call to the progress thread.
  Work submit(CallRecord record, bool p2p, const std::function<void(cudaStream_t)>& enqueue);
  // The progress thread: completes calls whose event fired, polls NCCL's
  // asynchronous error.
  void progress();
  // Takes a pending call off the queue and completes it (error: failed) in
  // the stats, the recorder, the trace and its Work.
  void finish(const std::shared_ptr<Pending>& call, std::exception_ptr error);
  // ncclCommAbort (once), then fails every pending call with `why`.
  void abort_with(const std::string& why);
  // Throws Error (peer for a system or remote error, else resource) naming the call.
  void check(ncclResult_t result, const char* call) const;
  // Widens n bf16 values into the f32 scratch (room for `capacity`) on `stream`.
  float* widen(const void* bf16, int64_t n, int64_t capacity, cudaStream_t stream);

  ncclComm_t comm_;
  int rank_, size_;
  std::string name_;
  Options options_;
  cudaStream_t stream_ = nullptr, p2p_stream_ = nullptr;
  cudaEvent_t compute_done_ = nullptr;
  int flight_comm_ = -1;
  std::unique_ptr<Scratch> scratch_;
  std::mutex submit_mutex_;
  std::atomic<uint64_t> next_seq_{0};
  std::mutex comm_mutex_;  // ncclCommAbort against the progress thread's polls of comm_
  std::atomic<bool> aborted_{false};
  CommTrace trace_;
  std::mutex pending_mutex_;
  std::condition_variable pending_cv_;
  std::deque<std::shared_ptr<Pending>> pending_;
  bool stop_ = false;
  std::thread progress_;  // last
};

// Aborts every live NcclCommunicator of this process; returns how many.
int abort_nccl_communicators();

}  // namespace meshtrain
