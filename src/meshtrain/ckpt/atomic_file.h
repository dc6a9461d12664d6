// A file that appears under its final name only when complete: bytes go to a
// temporary file beside the target, which is fsync'ed and renamed over it on
// commit(). A crash or an exception never leaves a half-written checkpoint.
#pragma once

#include "meshtrain/util/text_file.h"  // read_file_text, the other way

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace meshtrain {

class AtomicFile {
 public:
  // Creates the parent directory if needed and opens "<path>.tmp.<pid>".
  // direct: write around the page cache (O_DIRECT) where the filesystem allows
  // it (tmpfs does not: then buffered), for the writes whose memory, size and
  // file offset are 4096-aligned; the others (a header, a tail) go through
  // the page cache. Large sequential writes then run at the device's speed.
  explicit AtomicFile(std::string path, bool direct = false);
  ~AtomicFile();  // removes the temporary file unless committed
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  // fsync, close, rename over the target.
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_, temp_path_;
  int fd_ = -1;
  bool direct_ = false;  // fd_ was opened with O_DIRECT
  uint64_t offset_ = 0;  // bytes written so far
  bool committed_ = false;
};

// Whole-file convenience for small text files (config.json).
void write_file_atomic(const std::string& path, std::string_view text);

}  // namespace meshtrain
