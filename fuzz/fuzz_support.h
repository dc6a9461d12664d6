// What every harness shares. A reader of outside bytes may fail only with
// meshtrain::Error (docs/errors.md): run_reader swallows that and lets anything
// else escape, so libFuzzer (or standalone_main) reports it as a finding.
// Readers that take a path read files written into a scratch folder of this
// process (in $MESHTRAIN_FUZZ_SCRATCH, else /dev/shm when present), removed at exit.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <fcntl.h>
#include <unistd.h>

#include "meshtrain/util/error.h"

namespace meshtrain::fuzz {

class ScratchDir {
 public:
  ScratchDir() {
    // scripts/fuzz.sh names a folder it removes afterwards: a crash skips this
    // destructor.
    const char* given = std::getenv("MESHTRAIN_FUZZ_SCRATCH");
    const std::filesystem::path shm = "/dev/shm";
    const std::filesystem::path base = given != nullptr                 ? given
                                       : std::filesystem::is_directory(shm) ? shm
                                                                           : std::filesystem::temp_directory_path();
    path_ = (base / ("meshtrain_fuzz_" + std::to_string(::getpid()))).string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The scratch folder (created on first use), or a folder `name` inside it.
inline std::string scratch_dir(const std::string& name = "") {
  static const ScratchDir dir;
  if (name.empty()) return dir.path();
  const std::string sub = dir.path() + "/" + name;
  std::filesystem::create_directories(sub);
  return sub;
}

// Writes `bytes` to `path` (replacing it); returns the path.
inline std::string write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) std::abort();  // the scratch folder itself failed: not the reader's finding
  return path;
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// The lowest descriptor number free now. A descriptor left open takes the
// lowest free number, so a reader that leaks one moves this.
inline int lowest_free_fd() {
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::abort();  // out of descriptors: an earlier leak, or the harness's own fault
  ::close(fd);
  return fd;
}

// Runs `read`; meshtrain::Error is the documented outcome of bad input. With
// MESHTRAIN_FUZZ_VERBOSE set the error is printed (to see how far a seed gets).
// A reader must give back every file descriptor it opened, whichever way it
// ends: one left open is a finding here, not 20,000 inputs later.
template <typename Read>
void run_reader(Read&& read) {
  const int free_before = lowest_free_fd();
  try {
    read();
  } catch (const meshtrain::Error& e) {
    if (std::getenv("MESHTRAIN_FUZZ_VERBOSE")) std::fprintf(stderr, "error: %s\n", e.what());
  }
  if (const int free_after = lowest_free_fd(); free_after != free_before) {
    std::fprintf(stderr, "finding: the reader left file descriptor %d open\n", free_before);
    std::abort();
  }
}

}  // namespace meshtrain::fuzz
