// The MPI backend: one communication thread per process runs every MPI call
// (of every communicator) in issue order, so compute threads never block in
// MPI and MPI_THREAD_SERIALIZED suffices. MPI_Init_thread and MPI_Finalize
// run on the thread that owns the MpiEnvironment. Works under mpirun/srun and
// as a plain process (MPI singleton: one rank).
//
// Waiting for peers does not spin while compute runs: collectives of 64 KiB
// or more first meet in a nonblocking barrier that the thread tests now and
// then (20..500 us), asleep in between (MPI_Wait once a caller waits), then
// run MPI's blocking (tuned) collective with every peer present. send/recv
// and barrier are nonblocking requests awaited the same way.
//
// Because all communicators share that one thread, calls on different
// communicators are serialised too: a process that issues a tp collective and
// then a dp collective runs them in that order.
#pragma once

#include <mpi.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/flight_recorder.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain {

class CommThread;  // mpi.cpp

class MpiCommunicator final : public Communicator {
 public:
  ~MpiCommunicator() override;  // frees the MPI communicator after pending calls finish

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

  // Runs fn(this communicator's MPI_Comm) on the communication thread and
  // waits: raw MPI calls for benchmarks, outside the numbered calls.
  void run_raw(const std::function<void(MPI_Comm)>& fn);

 private:
  friend class MpiEnvironment;
  MpiCommunicator(std::shared_ptr<CommThread> thread, std::shared_ptr<FlightRecorder> flight,
                  MPI_Comm comm, std::string name, MemoryTracker& tracker);
  // Numbers the call and queues fn on the communication thread.
  Work submit(CallRecord record, std::function<void()> fn);
  std::string trace_args(const CallRecord& record) const;
  void trace_issue(const CallRecord& record) const;
  void trace_execution(const CallRecord& record, uint64_t flight_id) const;
  // f32 scratch for bf16 reductions (touched on the communication thread only).
  float* scratch(size_t floats);
  void reduce_scatter_call(const void* send, void* recv, const std::vector<int>& counts,
                           MPI_Datatype type, ReduceOp op, bool even);

  std::shared_ptr<CommThread> thread_;
  std::shared_ptr<FlightRecorder> flight_;
  int flight_comm_ = 0;  // this communicator's index in the recorder
  std::string trace_group_;  // JSON string naming it in timeline traces: "dp[0,2]"
  MPI_Comm comm_;
  std::string name_;
  MemoryTracker& tracker_;
  int rank_ = 0, size_ = 1;
  std::mutex submit_mutex_;  // sequence numbers follow queue order
  std::atomic<uint64_t> next_seq_{0};
  CommTrace trace_;
  Tensor scratch_;  // category comm
};

class MpiEnvironment {
 public:
  // MPI_Init_thread(MPI_THREAD_SERIALIZED). Throws Error when MPI is already
  // initialised or provides a lower thread level.
  MpiEnvironment();
  // Stops the communication thread and calls MPI_Finalize. Every communicator
  // must have been destroyed first.
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // Ranks of this job on this node (MPI_COMM_TYPE_SHARED), and this one's index among them.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }

  // A fresh communicator over all ranks (a duplicate of MPI_COMM_WORLD, so
  // its calls never match another's). Collective. Scratch buffers are counted
  // in `tracker`, which must outlive it.
  std::unique_ptr<MpiCommunicator> world(MemoryTracker& tracker, std::string name = "world");

  // Every call of every communicator of this process (comm/flight_recorder.h).
  FlightRecorder& flight() { return *flight_; }

  // Ends every rank of the job now (MPI_Abort on MPI_COMM_WORLD).
  [[noreturn]] void abort(int exit_code);

 private:
  std::shared_ptr<CommThread> thread_;
  std::shared_ptr<FlightRecorder> flight_ = std::make_shared<FlightRecorder>();
  int world_rank_ = 0, world_size_ = 1, local_rank_ = 0, local_size_ = 1;
};

// Threads per rank when the config leaves it open: the node's cores shared
// evenly by its ranks (local_ranks), never more than the cores this process
// may run on (available_cores: its affinity mask, which mpirun may have
// narrowed by binding), at least 1.
int default_threads_per_rank(int local_ranks, int available_cores);

}  // namespace meshtrain
