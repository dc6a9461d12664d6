// Advisory whole-file locks (flock(2)) that die with their holder: the kernel
// drops them when the last descriptor closes, so a process killed by SIGKILL
// leaves no stale lock. The descriptor is O_CLOEXEC: a child the holder starts
// does not inherit the lock.
#pragma once

#include <string>

namespace meshtrain {

class FileLock {
 public:
  enum class Mode { shared, exclusive };
  enum class Result {
    locked,       // held now
    held,         // another holder has a conflicting lock
    unsupported,  // the file system has no locks (ENOLCK, EOPNOTSUPP, ENOSYS): see error()
  };

  FileLock() = default;  // holds nothing
  // Opens `path` for reading and writing, creating it; an io Error when it cannot.
  explicit FileLock(std::string path);
  ~FileLock();
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  // Tries once, without waiting; converts a lock this object already holds
  // (flock's conversion is not atomic: another taker may come in between).
  Result try_lock(Mode mode);
  // try_lock every 20 ms until it does not answer `held` or `seconds` pass.
  Result lock_within(Mode mode, double seconds);
  // Waits for the lock as long as it takes: `locked` or `unsupported`.
  Result lock(Mode mode);
  // Lets go of the lock this object holds, if any (the file stays open).
  void unlock();
  // "<who> on host H, pid P" into the file, after locking it, so that a
  // refused taker can name the holder. Best effort: a failed write (a full
  // disk) is ignored.
  void write_holder(const std::string& who);
  // The holder line the file holds ("" when none was written).
  std::string holder() const;
  int error() const { return error_; }  // errno of an `unsupported` answer
  const std::string& path() const { return path_; }

 private:
  Result apply(int op);  // flock(2) with `op`, retried on EINTR

  std::string path_;
  int fd_ = -1;
  int error_ = 0;
};

}  // namespace meshtrain
