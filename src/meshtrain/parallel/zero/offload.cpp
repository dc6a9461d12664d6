#include "meshtrain/parallel/zero/offload.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>

#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain::zero {

namespace {

// File offsets of chunks are page aligned, so a later O_DIRECT path needs no new layout.
constexpr uint64_t kFileAlign = 4096;

std::string describe_bytes(size_t bytes) {
  return fmt::format("{} ({} bytes)", format_bytes(bytes), bytes);
}

using Clock = std::chrono::steady_clock;

}  // namespace

std::string_view offload_tier_name(OffloadTier tier) {
  switch (tier) {
    case OffloadTier::none: return "none";
    case OffloadTier::cpu: return "cpu";
    case OffloadTier::disk: return "disk";
  }
  return "?";
}

OffloadTier parse_offload_tier(std::string_view name) {
  if (name == "none") return OffloadTier::none;
  if (name == "cpu") return OffloadTier::cpu;
  if (name == "disk") return OffloadTier::disk;
  fail("offload: unknown tier '{}' (expected none, cpu or disk)", name);
}

OffloadStore::OffloadStore(std::string name, std::vector<OffloadChunkSpec> chunks,
                           OffloadOptions options, MemoryTracker& tracker)
    : name_(std::move(name)), options_(std::move(options)), tracker_(&tracker) {
  std::set<std::string_view> names;
  uint64_t offset = 0;
  chunks_.reserve(chunks.size());
  for (auto& spec : chunks) {
    MESHTRAIN_CHECK(spec.numel > 0, "offload store '{}': chunk '{}' has {} elements", name_,
                    spec.name, spec.numel);
    Chunk c;
    c.bytes = static_cast<size_t>(spec.numel) * dtype_size(spec.dtype);
    MESHTRAIN_CHECK(!streams() || options_.budget_bytes == 0 || c.bytes <= options_.budget_bytes,
                    "offload store '{}': chunk '{}' is {}, more than the resident budget of {}",
                    name_, spec.name, describe_bytes(c.bytes),
                    describe_bytes(options_.budget_bytes));
    c.file_offset = offset;
    offset += (c.bytes + kFileAlign - 1) / kFileAlign * kFileAlign;
    c.spec = std::move(spec);
    chunks_.push_back(std::move(c));
  }
  for (const auto& c : chunks_) {
    MESHTRAIN_CHECK(names.insert(c.spec.name).second, "offload store '{}': chunk '{}' given twice",
                    name_, c.spec.name);
  }
  switch (options_.tier) {
    case OffloadTier::none:
      for (auto& c : chunks_) c.home = new_buffer(c);
      return;  // no I/O thread
    case OffloadTier::cpu:
      for (auto& c : chunks_) {
        c.home = Tensor({c.spec.numel}, c.spec.dtype, MemCategory::offloaded, *tracker_,
                        host_staging());
      }
      break;
    case OffloadTier::disk: open_file(); break;
  }
  io_thread_ = std::thread([this] {
    trace::set_thread_name("offload io");
    io_loop();
  });
}

int remove_offload_files(const std::string& directory, const std::string& prefix) {
  namespace fs = std::filesystem;
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(directory, ec)) {
    if (!entry.path().filename().string().starts_with(prefix)) continue;
    std::error_code gone;
    if (fs::remove(entry.path(), gone)) ++removed;  // another rank may have removed it first
  }
  return removed;
}

void OffloadStore::open_file() {
  namespace fs = std::filesystem;
  MESHTRAIN_CHECK(!options_.directory.empty(),
                  "offload store '{}': the disk tier needs a directory", name_);
  std::error_code ec;
  MESHTRAIN_CHECK(fs::is_directory(options_.directory, ec),
                  "offload store '{}': directory '{}' does not exist or is not a directory", name_,
                  options_.directory);
  std::string file_name = fmt::format("{}{}-XXXXXX", options_.file_prefix, name_);
  std::replace(file_name.begin(), file_name.end(), '/', '_');
  std::string pattern = (fs::path(options_.directory) / file_name).string();
  fd_ = ::mkstemp(pattern.data());
  MESHTRAIN_CHECK_AS(ErrorKind::io, fd_ >= 0,
                     "offload store '{}': cannot create a file in '{}': {}", name_,
                     options_.directory, std::strerror(errno));
  path_ = pattern;
  uint64_t size = 0;
  for (const auto& c : chunks_) {
    size = c.file_offset + c.bytes;
    stored_bytes_ += c.bytes;
  }
  // Reserve the space now, so a full disk fails here and not in the middle of a step.
  // A file system without fallocate gets a sparse file (reads as zeros all the same).
  int rc = size == 0 ? 0 : ::posix_fallocate(fd_, 0, static_cast<off_t>(size));
  if (rc == EOPNOTSUPP || rc == EINVAL) rc = ::ftruncate(fd_, static_cast<off_t>(size)) == 0 ? 0 : errno;
  if (rc != 0) {
    ::close(fd_);
    ::unlink(path_.c_str());
    fd_ = -1;
    fail_as(ErrorKind::io, "offload store '{}': cannot reserve {} in '{}': {}", name_,
            describe_bytes(size), path_, std::strerror(rc));
  }
  tracker_->on_alloc(MemCategory::offloaded, stored_bytes_);
}

OffloadStore::~OffloadStore() {
  if (io_thread_.joinable()) {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    io_cv_.notify_all();
    io_thread_.join();
  }
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(path_.c_str());
    tracker_->on_free(MemCategory::offloaded, stored_bytes_);
  }
}

size_t OffloadStore::find(std::string_view chunk_name) const {
  for (size_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i].spec.name == chunk_name) return i;
  }
  fail("offload store '{}': no chunk named '{}'", name_, chunk_name);
}

void OffloadStore::check_no_error() {
  if (error_) std::rethrow_exception(error_);
}

void OffloadStore::begin_pass(std::vector<size_t> order) {
  std::unique_lock lock(mu_);
  check_no_error();
  MESHTRAIN_CHECK(!in_pass_, "offload store '{}': begin_pass inside a pass", name_);
  MESHTRAIN_CHECK(held_bytes_ == 0, "offload store '{}': begin_pass with chunks still held",
                  name_);
  for (size_t id : order) {
    MESHTRAIN_CHECK(id < chunks_.size(), "offload store '{}': pass names chunk {} of {}", name_,
                    id, chunks_.size());
  }
  order_ = std::move(order);
  next_read_ = next_acquire_ = 0;
  in_pass_ = true;
  lock.unlock();
  io_cv_.notify_all();
}

size_t OffloadStore::next_in_pass() const {
  std::lock_guard lock(mu_);
  return in_pass_ && next_acquire_ < order_.size() ? order_[next_acquire_] : npos;
}

Tensor OffloadStore::acquire(size_t id) {
  MESHTRAIN_CHECK(id < chunks_.size(), "offload store '{}': acquire of chunk {} of {}", name_, id,
                  chunks_.size());
  Chunk& c = chunks_[id];
  std::unique_lock lock(mu_);
  check_no_error();
  if (in_pass_) {
    MESHTRAIN_CHECK(next_acquire_ < order_.size() && order_[next_acquire_] == id,
                    "offload store '{}': acquired chunk '{}' but the pass order has {} next",
                    name_, c.spec.name,
                    next_acquire_ < order_.size()
                        ? fmt::format("'{}'", chunks_[order_[next_acquire_]].spec.name)
                        : std::string("nothing"));
  }
  MESHTRAIN_CHECK(c.state != State::held, "offload store '{}': chunk '{}' is already held", name_,
                  c.spec.name);
  if (!streams()) {
    if (in_pass_) ++next_acquire_;
    c.state = State::held;
    held_bytes_ += c.bytes;
    return c.home;
  }
  // Otherwise the wait below could never end: the budget is full of the caller's chunks.
  MESHTRAIN_CHECK(options_.budget_bytes == 0 || held_bytes_ + c.bytes <= options_.budget_bytes,
                  "offload store '{}': holding {} already, chunk '{}' ({}) exceeds the resident "
                  "budget of {}",
                  name_, describe_bytes(held_bytes_), c.spec.name, describe_bytes(c.bytes),
                  describe_bytes(options_.budget_bytes));
  if (in_pass_) {
    if (c.state == State::ready) {
      ++stats_.ready_at_acquire;
    } else {
      // Rather than sleep, the caller does the I/O that is due: the read it needs when the I/O
      // thread has not begun it, else a pending write (which frees room). A starved I/O
      // thread (no spare core) then costs no more than doing the pass synchronously.
      ++stats_.waited_at_acquire;
      auto start = Clock::now();
      while (c.state != State::ready && !error_) {
        if (can_read_ahead() && order_[next_read_] == id) {
          read_next(lock);
        } else if (!writes_.empty()) {
          write_next(lock);
        } else {
          done_cv_.wait(lock);
        }
      }
      stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - start).count();
      check_no_error();
    }
    ++next_acquire_;
  } else {
    load(c, lock);  // outside a pass the I/O thread is idle
    check_no_error();
  }
  c.state = State::held;
  held_bytes_ += c.bytes;
  return c.buffer;
}

void OffloadStore::release(size_t id, bool dirty) {
  MESHTRAIN_CHECK(id < chunks_.size(), "offload store '{}': release of chunk {} of {}", name_, id,
                  chunks_.size());
  Chunk& c = chunks_[id];
  std::unique_lock lock(mu_);
  MESHTRAIN_CHECK(c.state == State::held, "offload store '{}': release of chunk '{}' not held",
                  name_, c.spec.name);
  held_bytes_ -= c.bytes;
  if (!streams()) {
    c.state = State::stored;
    return;
  }
  if (in_pass_) {
    if (dirty) {
      c.state = State::writing;
      writes_.push_back(id);
      lock.unlock();
      io_cv_.notify_all();
    } else {
      c.state = State::stored;
      spare_bytes_ += c.bytes;
      spares_.push_back(std::move(c.buffer));
      c.buffer = Tensor();
      lock.unlock();
      io_cv_.notify_all();
    }
    return;
  }
  if (dirty) run_io(lock, [&] { transfer(c, c.buffer, true); });
  c.state = State::stored;
  resident_bytes_ -= c.bytes;
  c.buffer = Tensor();
  check_no_error();
}

void OffloadStore::end_pass() {
  std::unique_lock lock(mu_);
  MESHTRAIN_CHECK(in_pass_, "offload store '{}': end_pass outside a pass", name_);
  auto start = Clock::now();
  // Stop the read-ahead; write back what is pending, with the I/O thread; wait for both.
  next_read_ = order_.size();
  while (!writes_.empty() && !error_) write_next(lock);
  done_cv_.wait(lock, [&] { return io_in_flight_ == 0; });  // in-flight transfers always end
  stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  in_pass_ = false;
  check_no_error();
  std::vector<Tensor> to_free = std::move(spares_);
  spares_.clear();
  for (auto& c : chunks_) {
    if (c.state == State::ready) {  // read ahead, never acquired
      to_free.push_back(std::move(c.buffer));
      c.buffer = Tensor();
      c.state = State::stored;
    }
  }
  for (const auto& t : to_free) resident_bytes_ -= t.bytes();
  spare_bytes_ = 0;
  lock.unlock();
  to_free.clear();
  // Held chunks keep their buffers; release() outside a pass writes and frees them.
  MESHTRAIN_CHECK(held_bytes_ == 0, "offload store '{}': end_pass with chunks still held", name_);
}

void OffloadStore::wait_idle() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock,
                [&] { return (io_in_flight_ == 0 && writes_.empty() && !can_read_ahead()) || error_; });
  check_no_error();
}

OffloadStats OffloadStore::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

bool OffloadStore::can_read_ahead() const {
  if (!in_pass_ || error_ || next_read_ >= order_.size()) return false;
  const Chunk& next = chunks_[order_[next_read_]];
  // A repeated chunk: its earlier occurrence is not released (or written back) yet.
  if (next.state != State::stored) return false;
  if (options_.budget_bytes == 0) return true;
  for (const auto& t : spares_) {
    if (fits(t, next)) return true;
  }
  return resident_bytes_ - spare_bytes_ + next.bytes <= options_.budget_bytes;
}

Tensor OffloadStore::take_buffer(const Chunk& chunk) {
  const size_t bytes = chunk.bytes;
  for (size_t i = 0; i < spares_.size(); ++i) {
    if (fits(spares_[i], chunk)) {
      Tensor t = std::move(spares_[i]);
      spares_.erase(spares_.begin() + static_cast<long>(i));
      spare_bytes_ -= bytes;
      return t;
    }
  }
  // Free spares of other sizes until the new buffer fits. Freed here, under the lock, so
  // that no other thread's allocation can count while they still do: the peak stays in budget.
  while (!spares_.empty() && options_.budget_bytes != 0 &&
         resident_bytes_ + bytes > options_.budget_bytes) {
    resident_bytes_ -= spares_.back().bytes();
    spare_bytes_ -= spares_.back().bytes();
    spares_.pop_back();
  }
  resident_bytes_ += bytes;
  return Tensor();
}

const Allocator& OffloadStore::host_staging() const {
  return options_.device != nullptr ? options_.device->staging_allocator() : host_allocator();
}

Tensor OffloadStore::new_buffer(const Chunk& chunk) {
  if (options_.device != nullptr) {
    return options_.device->allocate({chunk.spec.numel}, chunk.spec.dtype,
                                     options_.resident_category);
  }
  return Tensor({chunk.spec.numel}, chunk.spec.dtype, options_.resident_category, *tracker_);
}

void OffloadStore::io_loop() {
  std::unique_lock lock(mu_);
  while (true) {
    io_cv_.wait(lock, [&] { return stop_ || (!error_ && (!writes_.empty() || can_read_ahead())); });
    if (stop_) return;
    // The chunk the caller needs next goes first; otherwise writes, which free room.
    const bool caller_needs_read = next_read_ == next_acquire_ && can_read_ahead();
    if (!writes_.empty() && !caller_needs_read) {
      write_next(lock);
    } else {
      read_next(lock);
    }
  }
}

void OffloadStore::load(Chunk& c, std::unique_lock<std::mutex>& lock) {
  c.buffer = take_buffer(c);
  c.state = State::reading;
  run_io(lock, [&] {
    if (!c.buffer.defined()) c.buffer = new_buffer(c);
    transfer(c, c.buffer, false);
  });
}

void OffloadStore::read_next(std::unique_lock<std::mutex>& lock) {
  Chunk& c = chunks_[order_[next_read_++]];
  load(c, lock);
  if (!error_) c.state = State::ready;
}

void OffloadStore::write_next(std::unique_lock<std::mutex>& lock) {
  Chunk& c = chunks_[writes_.front()];
  writes_.pop_front();
  run_io(lock, [&] { transfer(c, c.buffer, true); });
  if (error_) return;
  c.state = State::stored;
  spare_bytes_ += c.bytes;
  spares_.push_back(std::move(c.buffer));
  c.buffer = Tensor();
  io_cv_.notify_all();  // room for the read-ahead
}

void OffloadStore::run_io(std::unique_lock<std::mutex>& lock, const std::function<void()>& io) {
  ++io_in_flight_;
  lock.unlock();
  std::exception_ptr error;
  try {
    io();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  --io_in_flight_;
  if (error && !error_) error_ = error;  // the store is unusable from here on
  done_cv_.notify_all();
}

void OffloadStore::transfer(const Chunk& c, const Tensor& buffer, bool to_tier) {
  trace::Span span("offload", to_tier ? "write" : "read");
  span.args(R"("chunk":{},"bytes":{})", trace::quote(c.spec.name), c.bytes);
  auto start = Clock::now();
  // A device whose memory is the host's needs no copies through its backend.
  Backend* device = options_.device != nullptr && !options_.device->device().is_host()
                        ? options_.device
                        : nullptr;
  if (options_.tier == OffloadTier::cpu) {
    if (device == nullptr) {
      std::memcpy(to_tier ? c.home.raw() : buffer.raw(), to_tier ? buffer.raw() : c.home.raw(),
                  c.bytes);
    } else if (to_tier) {
      device->copy_to_host(buffer, c.home.raw());
    } else {
      device->copy_from_host(c.home.raw(), buffer);
    }
  } else if (device == nullptr) {
    file_io(c, static_cast<char*>(buffer.raw()), to_tier);
  } else {
    const Tensor staging({c.spec.numel}, c.spec.dtype, MemCategory::offloaded, *tracker_,
                         host_staging());
    if (to_tier) device->copy_to_host(buffer, staging.raw());
    file_io(c, static_cast<char*>(staging.raw()), to_tier);
    if (!to_tier) device->copy_from_host(staging.raw(), buffer);
  }
  std::lock_guard lock(mu_);
  stats_.io_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  (to_tier ? stats_.writes : stats_.reads) += 1;
  (to_tier ? stats_.bytes_written : stats_.bytes_read) += c.bytes;
}

void OffloadStore::file_io(const Chunk& c, char* bytes, bool to_tier) {
  size_t done = 0;
  while (done < c.bytes) {  // pread/pwrite may move fewer bytes than asked
    const auto at = static_cast<off_t>(c.file_offset + done);
    ssize_t n = to_tier ? ::pwrite(fd_, bytes + done, c.bytes - done, at)
                        : ::pread(fd_, bytes + done, c.bytes - done, at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      fail_as(ErrorKind::io, "offload store '{}': {} chunk '{}' ({} at offset {}) {} '{}': {}",
              name_, to_tier ? "writing" : "reading", c.spec.name, describe_bytes(c.bytes),
              c.file_offset, to_tier ? "to" : "from", path_,
              n < 0     ? std::string(std::strerror(errno))
              : to_tier ? std::string("nothing written")
                        : fmt::format("file ends after {} of its bytes", done));
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace meshtrain::zero
