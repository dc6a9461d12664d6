// Offload store: named, fixed-size chunks (ZeRO's optimizer-state shards, the f32
// master shards of 2-byte weights and, at stage 3, the parameter shards: f32, or
// 2-byte compute chunks in their own dtype) kept in a slower tier and streamed
// through a bounded set of resident buffers, with read-ahead and write-behind on an
// I/O thread.
//
// Tiers:
//   none  every chunk is one resident Tensor; acquire returns it, nothing is copied.
//   cpu   a host copy per chunk (pinned host memory on GPUs; RAM here), copied into
//         and out of separate resident working buffers.
//   disk  one file per store in `directory`, read and written with pread/pwrite
//         (like ZeRO-Infinity's NVMe tier); on a device through a host staging
//         buffer per transfer (category offloaded).
// Resident buffers are options.device's memory (Backend::allocate), moved to and
// from the tier with its copy_to_host / copy_from_host.
//
// Use, one caller thread:
//   OffloadStore store("opt", {{"layers.0.exp_avg", n0}, ...}, options, tracker);
//   store.begin_pass({0, 1, 2, ...});          // order of this pass; read-ahead starts
//   for (id : order) { Tensor t = store.acquire(id); ...; t = {}; store.release(id, true); }
//   store.end_pass();                          // writes back what is pending, frees buffers
// Within a pass chunks are acquired in the announced order (several may be held at
// once, within the budget). A chunk may appear more than once (ZeRO-3 reads a unit's
// parameters in forward and again in backward): the read-ahead of a later occurrence
// waits until the earlier one is released. A caller whose chunk is not read yet does the
// due I/O itself rather than sleep. Outside a pass acquire/release do the I/O on the
// caller's thread (checkpoint save/load, initial values). Chunks start zero-filled.
//
// Memory: resident buffers (held, read ahead, or waiting to be written), whatever chunk
// they hold, count under options.resident_category and never exceed options.budget_bytes
// together; the slower tier (host copies, file bytes) counts as MemCategory::offloaded.
// Errors (bad directory, chunk over budget, failed or short I/O) throw Error naming
// the store, the chunk and the file. After an I/O failure (on either thread) the store
// is unusable: every later call rethrows it. The disk file is removed on destruction.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "meshtrain/backend/backend.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::zero {

enum class OffloadTier : uint8_t { none, cpu, disk };

std::string_view offload_tier_name(OffloadTier tier);
// "none" | "cpu" | "disk"; anything else throws.
OffloadTier parse_offload_tier(std::string_view name);

struct OffloadOptions {
  OffloadTier tier = OffloadTier::none;
  std::string directory;  // disk: an existing directory for the store's file
  // disk: the file is <directory>/<file_prefix><store name>-XXXXXX. A run
  // names its files by a prefix of its own, so a restart finds and removes
  // the ones a killed attempt left (remove_offload_files).
  std::string file_prefix = "meshtrain-offload-";
  // cpu/disk: most bytes of resident chunk buffers at once (0 = no limit).
  size_t budget_bytes = 0;
  MemCategory resident_category = MemCategory::optimizer;
  // Where resident buffers live (the tier none's chunks included), and what
  // copies them to and from the slower tier; nullptr: host memory.
  Backend* device = nullptr;
};

// Removes the files in `directory` whose names start with `prefix` (a killed
// run's stores: a store removes its own file on destruction, a SIGKILL
// leaves it); returns how many. Call before any store with that prefix opens.
int remove_offload_files(const std::string& directory, const std::string& prefix);

struct OffloadChunkSpec {
  std::string name;
  int64_t numel = 0;         // elements of dtype
  DType dtype = DType::f32;  // the resident buffer's element type
};

struct OffloadStats {
  size_t reads = 0, writes = 0;  // chunk transfers from / to the slower tier
  size_t bytes_read = 0, bytes_written = 0;
  size_t ready_at_acquire = 0;   // pass acquires that found their chunk already read ahead
  size_t waited_at_acquire = 0;  // pass acquires whose chunk was not read yet (waited or read it)
  double io_seconds = 0;         // time spent in reads and writes (either thread)
  double wait_seconds = 0;       // caller time in acquire and end_pass (waiting or doing I/O)
};

class OffloadStore {
 public:
  // Creates the tier (for disk the file, space reserved). Throws if a chunk alone
  // exceeds the budget, names repeat, or the directory is unusable.
  OffloadStore(std::string name, std::vector<OffloadChunkSpec> chunks, OffloadOptions options,
               MemoryTracker& tracker);
  // Stops the I/O thread (unwritten data is dropped), frees the buffers, removes the file.
  ~OffloadStore();
  OffloadStore(const OffloadStore&) = delete;
  OffloadStore& operator=(const OffloadStore&) = delete;

  const std::string& name() const { return name_; }
  OffloadTier tier() const { return options_.tier; }
  size_t num_chunks() const { return chunks_.size(); }
  const OffloadChunkSpec& chunk(size_t id) const { return chunks_.at(id).spec; }
  size_t find(std::string_view chunk_name) const;  // throws if absent
  const std::string& file_path() const { return path_; }  // disk only, else empty

  // Starts a pass over `order` (chunk ids, repeats allowed; nothing may be held).
  void begin_pass(std::vector<size_t> order);
  // In a pass: the chunk the order names next (npos at its end or outside a pass).
  static constexpr size_t npos = static_cast<size_t>(-1);
  size_t next_in_pass() const;
  // The chunk's resident values, a [numel] tensor of its dtype valid until release(id). It
  // shares the store's buffer: drop it before release, since the store may then reuse
  // or free the buffer (a copy kept alive would hold memory outside the budget). In a
  // pass `id` must be the next in the order; blocks until it is read.
  Tensor acquire(size_t id);
  // dirty: the values changed and go back to the slower tier (written behind in a pass).
  void release(size_t id, bool dirty);
  // Waits for the pending writes, drops chunks read ahead but not acquired.
  void end_pass();
  bool in_pass() const { return in_pass_; }

  // Tests and benchmarks: blocks until the I/O thread has nothing it may do now.
  void wait_idle();
  OffloadStats stats() const;

 private:
  enum class State : uint8_t { stored, reading, ready, held, writing };
  struct Chunk {
    OffloadChunkSpec spec;
    size_t bytes = 0;
    uint64_t file_offset = 0;  // disk
    Tensor home;               // none: the chunk itself; cpu: its host copy
    Tensor buffer;             // cpu/disk: resident working buffer while not stored
    State state = State::stored;
  };

  bool streams() const { return options_.tier != OffloadTier::none; }
  // Functions below require mu_ held; those taking `lock` release it around the I/O.
  void io_loop();
  bool can_read_ahead() const;
  void check_no_error();
  // Reserves room for `bytes` (reusing or freeing spares); returns a spare of that size
  // or an undefined tensor to allocate outside the lock.
  Tensor take_buffer(const Chunk& chunk);
  bool fits(const Tensor& spare, const Chunk& chunk) const {
    return spare.bytes() == chunk.bytes && spare.dtype() == chunk.spec.dtype;
  }
  void load(Chunk& chunk, std::unique_lock<std::mutex>& lock);  // buffer + read
  void read_next(std::unique_lock<std::mutex>& lock);           // order_[next_read_], read ahead
  void write_next(std::unique_lock<std::mutex>& lock);          // writes_.front()
  // Runs `io` unlocked, counted in io_in_flight_; a failure becomes error_.
  void run_io(std::unique_lock<std::mutex>& lock, const std::function<void()>& io);
  Tensor new_buffer(const Chunk& chunk);  // resident memory for the chunk
  // Host memory of the cpu tier and of the disk tier's staging: the device's
  // staging allocator (page-locked on a GPU), or plain host memory.
  const Allocator& host_staging() const;
  // Copies the chunk between `buffer` and its tier (to_tier: a write), counts it in stats_.
  void transfer(const Chunk& chunk, const Tensor& buffer, bool to_tier);
  // The disk tier's pread / pwrite of the chunk's bytes at `bytes` (host memory).
  void file_io(const Chunk& chunk, char* bytes, bool to_tier);
  void open_file();

  std::string name_;
  OffloadOptions options_;
  MemoryTracker* tracker_;
  std::vector<Chunk> chunks_;
  std::string path_;
  int fd_ = -1;
  size_t stored_bytes_ = 0;  // disk: counted as offloaded

  mutable std::mutex mu_;
  std::condition_variable io_cv_;    // wakes the I/O thread
  std::condition_variable done_cv_;  // wakes the caller
  bool in_pass_ = false;
  std::vector<size_t> order_;
  size_t next_read_ = 0, next_acquire_ = 0;
  std::deque<size_t> writes_;
  std::vector<Tensor> spares_;  // released buffers kept for reuse during a pass
  size_t spare_bytes_ = 0;
  size_t resident_bytes_ = 0;  // every buffer, spares included
  size_t held_bytes_ = 0;
  size_t io_in_flight_ = 0;  // transfers running on either thread
  bool stop_ = false;
  std::exception_ptr error_;
  OffloadStats stats_;
  std::thread io_thread_;
};

}  // namespace meshtrain::zero
