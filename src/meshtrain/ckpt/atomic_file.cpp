#include "meshtrain/ckpt/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

constexpr uint64_t kDirectAlign = 4096;

// Turns O_DIRECT on or off for the next writes.
void set_direct(int fd, bool on, const std::string& path) {
  const int flags = ::fcntl(fd, F_GETFL);
  MESHTRAIN_CHECK_AS(
      ErrorKind::io,
      flags >= 0 && ::fcntl(fd, F_SETFL, on ? flags | O_DIRECT : flags & ~O_DIRECT) == 0,
      "{}: cannot change O_DIRECT: {}", path, std::strerror(errno));
}

}  // namespace

AtomicFile::AtomicFile(std::string path, bool direct) : path_(std::move(path)) {
  std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    MESHTRAIN_CHECK(!ec, "{}: cannot create directory {}: {}", path_, parent.string(), ec.message());
  }
  temp_path_ = fmt::format("{}.tmp.{}", path_, ::getpid());
  constexpr int kFlags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (direct) {
    fd_ = ::open(temp_path_.c_str(), kFlags | O_DIRECT, 0644);
    direct_ = fd_ >= 0;
  }
  if (fd_ < 0) fd_ = ::open(temp_path_.c_str(), kFlags, 0644);
  MESHTRAIN_CHECK_AS(ErrorKind::io, fd_ >= 0, "{}: cannot create {}: {}", path_, temp_path_,
                     std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_path_.c_str());
}

void AtomicFile::write(const void* data, size_t bytes) {
  MESHTRAIN_CHECK(fd_ >= 0 && !committed_, "{}: write after commit", path_);
  const char* p = static_cast<const char*>(data);
  // O_DIRECT takes only aligned memory, sizes and offsets: the rest is buffered.
  const bool aligned = reinterpret_cast<uintptr_t>(p) % kDirectAlign == 0 &&
                       bytes % kDirectAlign == 0 && offset_ % kDirectAlign == 0;
  if (direct_ && !aligned) set_direct(fd_, false, path_);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    MESHTRAIN_CHECK_AS(ErrorKind::io, n > 0, "{}: write failed: {}", path_, std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
    offset_ += static_cast<uint64_t>(n);
  }
  if (direct_ && !aligned) set_direct(fd_, true, path_);
}

void AtomicFile::commit() {
  MESHTRAIN_CHECK(fd_ >= 0 && !committed_, "{}: commit twice", path_);
  MESHTRAIN_CHECK_AS(ErrorKind::io, ::fsync(fd_) == 0, "{}: fsync failed: {}", path_,
                     std::strerror(errno));
  int rc = ::close(fd_);
  fd_ = -1;
  MESHTRAIN_CHECK_AS(ErrorKind::io, rc == 0, "{}: close failed: {}", path_, std::strerror(errno));
  MESHTRAIN_CHECK_AS(ErrorKind::io, ::rename(temp_path_.c_str(), path_.c_str()) == 0,
                     "{}: rename from {} failed: {}", path_, temp_path_, std::strerror(errno));
  committed_ = true;
}

void write_file_atomic(const std::string& path, std::string_view text) {
  AtomicFile file(path);
  file.write(text);
  file.commit();
}

}  // namespace meshtrain
