#include "meshtrain/util/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "meshtrain/util/error.h"

namespace meshtrain {

FileLock::FileLock(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MESHTRAIN_CHECK_AS(ErrorKind::io, fd_ >= 0, "cannot open lock file '{}': {}", path_,
                     std::strerror(errno));
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);
}

FileLock::FileLock(FileLock&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), error_(other.error_) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    error_ = other.error_;
  }
  return *this;
}

FileLock::Result FileLock::try_lock(Mode mode) {
  return apply((mode == Mode::exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB);
}

FileLock::Result FileLock::lock(Mode mode) {
  return apply(mode == Mode::exclusive ? LOCK_EX : LOCK_SH);
}

void FileLock::unlock() {
  if (fd_ >= 0) ::flock(fd_, LOCK_UN);  // fails only for a bad descriptor
}

FileLock::Result FileLock::apply(int op) {
  int rc;
  do {
    rc = ::flock(fd_, op);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return Result::locked;
  if (errno == EWOULDBLOCK) return Result::held;
  if (errno == ENOLCK || errno == EOPNOTSUPP || errno == ENOSYS) {
    error_ = errno;
    return Result::unsupported;
  }
  fail_as(ErrorKind::io, "cannot lock '{}': {}", path_, std::strerror(errno));
}

FileLock::Result FileLock::lock_within(Mode mode, double seconds) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
  for (;;) {
    const Result r = try_lock(mode);
    if (r != Result::held || std::chrono::steady_clock::now() >= until) return r;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void FileLock::write_holder(const std::string& who) {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string line = fmt::format("{} on host {}, pid {}\n", who, host, ::getpid());
  if (::ftruncate(fd_, 0) != 0) return;
  [[maybe_unused]] ssize_t n = ::pwrite(fd_, line.data(), line.size(), 0);
}

std::string FileLock::holder() const {
  char buf[512];
  const ssize_t n = ::pread(fd_, buf, sizeof(buf), 0);
  if (n <= 0) return {};
  std::string line(buf, static_cast<size_t>(n));
  const size_t end = line.find('\n');
  return end == std::string::npos ? std::string() : line.substr(0, end);  // a whole line only
}

}  // namespace meshtrain
