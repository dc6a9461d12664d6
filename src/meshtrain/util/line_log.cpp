#include "meshtrain/util/line_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

// Cuts a partial last line (a writer killed mid-write) off `path`, if any.
void drop_partial_line(const std::string& path) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec || size == 0) return;
  std::ifstream in(path, std::ios::binary);
  // Back from the end, a block at a time, to the last newline.
  uintmax_t end = size, keep = 0;
  std::string block;
  while (end > 0) {
    const uintmax_t begin = end > 65536 ? end - 65536 : 0;
    block.resize(end - begin);
    in.seekg(static_cast<std::streamoff>(begin));
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "cannot read '{}'", path);
    const size_t nl = block.rfind('\n');
    if (nl != std::string::npos) {
      keep = begin + nl + 1;
      break;
    }
    end = begin;
  }
  if (keep == size) return;
  std::filesystem::resize_file(path, keep, ec);
  MESHTRAIN_CHECK_AS(ErrorKind::io, !ec, "cannot cut the partial last line of '{}': {}", path,
                     ec.message());
}

}  // namespace

LineLog::LineLog(std::string path, bool truncate, std::string what)
    : path_(std::move(path)), what_(std::move(what)) {
  const int flags = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0);
  fd_ = UniqueFd(::open(path_.c_str(), flags, 0644));
  MESHTRAIN_CHECK_AS(ErrorKind::io, fd_.valid(), "cannot write {} '{}': {}", what_, path_,
                     std::strerror(errno));
  lock_ = FileLock(path_);
  if (!truncate) {
    // No other writer is inside a line while the cut looks for one. A throw
    // lets go of the lock with lock_'s descriptor.
    lock_.lock(FileLock::Mode::exclusive);
    drop_partial_line(path_);
    lock_.unlock();
  }
}

void LineLog::append(const std::string& line) {
  std::string whole = line;
  whole += '\n';
  lock_.lock(FileLock::Mode::shared);
  ssize_t n;
  do {
    n = ::write(fd_.get(), whole.data(), whole.size());
  } while (n < 0 && errno == EINTR);
  const int write_errno = errno;
  lock_.unlock();
  // A short write (no space) is not continued: the rest would be a torn line.
  MESHTRAIN_CHECK_AS(ErrorKind::io, n == static_cast<ssize_t>(whole.size()),
                     "cannot write {} '{}': {}", what_, path_,
                     n < 0 ? std::strerror(write_errno) : "short write (disk full?)");
}

}  // namespace meshtrain
