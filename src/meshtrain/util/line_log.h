// An append-only file of lines (metrics.jsonl, launch.jsonl). Each line goes
// to the file in one write(2) on an O_APPEND descriptor, so lines of writers
// never interleave and a process killed between writes leaves whole lines. A
// kill during the write itself can still cut the last line (Linux checks for
// a fatal signal between pages): readers skip a partial last line, and the
// next writer cuts it off when it opens the file. That cut must not take a
// line another live writer is halfway through (the file grows a page at a
// time during a write): each write holds a shared flock(2) on the file, the
// cut an exclusive one. Where the file system has no locks, the cut goes ahead
// without (docs/launch.md: then nothing keeps a second run out either).
#pragma once

#include <string>

#include "meshtrain/util/file_lock.h"
#include "meshtrain/util/unique_fd.h"

namespace meshtrain {

class LineLog {
 public:
  // `what` names the file in errors ("metrics file"): an io Error
  // "cannot write <what> '<path>': <reason>". truncate: start the file empty;
  // else a partial last line is cut off first.
  LineLog(std::string path, bool truncate, std::string what);
  LineLog(const LineLog&) = delete;
  LineLog& operator=(const LineLog&) = delete;

  void append(const std::string& line);  // the line and its '\n', in one write
  const std::string& path() const { return path_; }

 private:
  std::string path_, what_;
  UniqueFd fd_;
  FileLock lock_;
};

}  // namespace meshtrain
