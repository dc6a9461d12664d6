// An append-only file of lines (metrics.jsonl, launch.jsonl). Each line goes
// to the file in one write(2) on an O_APPEND descriptor, so lines of writers
// never interleave and a process killed between writes leaves whole lines. A
// kill during the write itself can still cut the last line (Linux checks for
// a fatal signal between pages): readers skip a partial last line, and the
// next writer cuts it off when it opens the file.
#pragma once

#include <string>

namespace meshtrain {

class LineLog {
 public:
  // `what` names the file in errors ("metrics file"): an io Error
  // "cannot write <what> '<path>': <reason>". truncate: start the file empty.
  LineLog(std::string path, bool truncate, std::string what);
  ~LineLog();
  LineLog(const LineLog&) = delete;
  LineLog& operator=(const LineLog&) = delete;

  void append(const std::string& line);  // the line and its '\n', in one write
  const std::string& path() const { return path_; }

 private:
  std::string path_, what_;
  int fd_ = -1;
};

// Cuts a partial last line (a writer killed mid-write) off `path`, if any.
void drop_partial_line(const std::string& path);

}  // namespace meshtrain
