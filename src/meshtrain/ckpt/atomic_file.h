// A file that appears under its final name only when complete: bytes go to a
// temporary file beside the target, which is fsync'ed and renamed over it on
// commit(). A crash or an exception never leaves a half-written checkpoint.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace meshtrain {

class AtomicFile {
 public:
  // Creates the parent directory if needed and opens "<path>.tmp.<pid>".
  explicit AtomicFile(std::string path);
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
  bool committed_ = false;
};

// Whole-file convenience for small text files (config.json).
void write_file_atomic(const std::string& path, std::string_view text);

}  // namespace meshtrain
