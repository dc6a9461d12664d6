// Locks and line logs against real processes: a child that holds a lock or
// writes lines, killed with SIGKILL at random moments.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "meshtrain/util/error.h"
#include "meshtrain/util/file_lock.h"
#include "meshtrain/util/line_log.h"
#include "meshtrain/util/out_dir_lock.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("meshtrain_{}_{}", name, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A child process that runs `body` and then sleeps until killed; the parent
// goes on once the child wrote a byte to the pipe (after `body`).
pid_t spawn_holder(const std::function<void()>& body) {
  int ready[2];
  EXPECT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ready[0]);
    body();
    const char byte = 1;
    [[maybe_unused]] ssize_t n = ::write(ready[1], &byte, 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char byte = 0;
  EXPECT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  return pid;
}

void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

TEST(FileLock, ExclusiveUntilTheHolderIsKilled) {
  const fs::path dir = fresh_dir("file_lock");
  const std::string path = (dir / "x.lock").string();
  const pid_t holder = spawn_holder([&] {
    FileLock* lock = new FileLock(path);  // held until the process dies
    if (lock->try_lock(FileLock::Mode::exclusive) != FileLock::Result::locked) ::_exit(3);
    lock->write_holder("test holder");
  });
  FileLock mine(path);
  EXPECT_EQ(mine.try_lock(FileLock::Mode::exclusive), FileLock::Result::held);
  EXPECT_EQ(mine.try_lock(FileLock::Mode::shared), FileLock::Result::held);
  EXPECT_EQ(mine.holder(), fmt::format("test holder on host {}, pid {}",
                                       [] {
                                         char h[256] = {};
                                         ::gethostname(h, sizeof(h) - 1);
                                         return std::string(h);
                                       }(),
                                       holder));
  kill_and_reap(holder);
  EXPECT_EQ(mine.try_lock(FileLock::Mode::exclusive), FileLock::Result::locked);
  fs::remove_all(dir);
}

TEST(OutDirLock, ASecondRunIsRefusedNamingTheHolder) {
  const fs::path dir = fresh_dir("out_dir_lock") / "run";
  const pid_t first = spawn_holder([&] {
    std::string warning;
    new OutDirLocks(lock_out_dir(dir.string(), false, &warning));
  });
  std::string warning;
  try {
    lock_out_dir(dir.string(), false, &warning);
    ADD_FAILURE() << "a second run took a live out_dir";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::busy);
    EXPECT_NE(std::string(e.what()).find(fmt::format("pid {}", first)), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("owner.lock"), std::string::npos) << e.what();
  }
  // Under launch the owner lock is the supervisor's; the ranks still refuse.
  EXPECT_THROW(lock_out_dir(dir.string(), true, &warning), Error);
  EXPECT_THROW(lock_launch(dir.string(), &warning), Error);
  kill_and_reap(first);
  EXPECT_NO_THROW(lock_out_dir(dir.string(), false, &warning));
  EXPECT_TRUE(warning.empty());
  fs::remove_all(dir.parent_path());
}

TEST(OutDirLock, ARankOfAnEarlierJobKeepsOutDir) {
  const fs::path dir = fresh_dir("out_dir_drain");
  // A rank whose rank 0 is gone: only ranks.lock, shared.
  const pid_t rank = spawn_holder([&] { new FileLock(join_out_dir(dir.string())); });
  EXPECT_EQ(wait_out_dir_free(dir.string(), 0.1), "holder unknown");
  std::string warning;
  EXPECT_THROW(lock_out_dir(dir.string(), true, &warning), Error);
  kill_and_reap(rank);
  EXPECT_EQ(wait_out_dir_free(dir.string(), 0.1), "");
  OutDirLocks locks = lock_out_dir(dir.string(), true, &warning);
  FileLock other = join_out_dir(dir.string());  // this job's other ranks share it
  fs::remove_all(dir);
}

// A rank of the job before, still unwinding (another Trainer in the same
// processes: a test's second job in one out_dir): rank 0 waits a moment.
TEST(OutDirLock, ARankStillUnwindingGetsAMoment) {
  const fs::path dir = fresh_dir("out_dir_unwind");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t rank = ::fork();
  if (rank == 0) {
    ::close(ready[0]);
    FileLock held = join_out_dir(dir.string());
    const char byte = 1;
    [[maybe_unused]] ssize_t n = ::write(ready[1], &byte, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::_exit(0);
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  std::string warning;
  EXPECT_NO_THROW(lock_out_dir(dir.string(), false, &warning));
  int status = 0;
  ::waitpid(rank, &status, 0);
  fs::remove_all(dir);
}

// Two processes appending at once: whole lines, never interleaved.
TEST(LineLog, ConcurrentWritersNeverInterleave) {
  const fs::path dir = fresh_dir("line_log");
  const std::string path = (dir / "log.jsonl").string();
  const std::string a(3000, 'a'), b(5000, 'b');
  const pid_t child = ::fork();
  if (child == 0) {
    LineLog log(path, false, "log");
    for (int i = 0; i < 2000; ++i) log.append(b);
    ::_exit(0);
  }
  {
    LineLog log(path, false, "log");
    for (int i = 0; i < 2000; ++i) log.append(a);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::ifstream in(path);
  int as = 0, bs = 0;
  for (std::string line; std::getline(in, line);) {
    if (line == a) ++as;
    else if (line == b) ++bs;
    else ADD_FAILURE() << "a torn line of " << line.size() << " bytes";
  }
  EXPECT_EQ(as, 2000);
  EXPECT_EQ(bs, 2000);
  fs::remove_all(dir);
}

// A writer that opens the log (and so looks for a partial last line to cut)
// while another is halfway through a long record: the file has grown by only
// part of that record, which must not be taken for a torn line.
TEST(LineLog, OpeningBesideALiveWriterCutsNothing) {
  const fs::path dir = fresh_dir("line_open");
  const std::string path = (dir / "log.jsonl").string();
  const std::string record(1 << 20, 'r');  // 256 pages: a long window mid-write
  constexpr int kRecords = 150;
  LineLog{path, true, "log"};
  const pid_t child = ::fork();
  if (child == 0) {
    for (;;) LineLog{path, false, "log"};  // open, cut what looks partial, close
  }
  {
    LineLog log(path, false, "log");
    for (int i = 0; i < kRecords; ++i) log.append(record);
  }
  kill_and_reap(child);
  std::ifstream in(path);
  int whole = 0;
  for (std::string line; std::getline(in, line);) {
    if (line == record) ++whole;
    else ADD_FAILURE() << "a torn line of " << line.size() << " bytes";
  }
  EXPECT_EQ(whole, kRecords);
  fs::remove_all(dir);
}

// A writer killed at random moments, again and again, each next writer
// appending to what it left: only whole lines in the end.
TEST(LineLog, KilledWritersLeaveWholeLines) {
  const fs::path dir = fresh_dir("line_kill");
  const std::string path = (dir / "log.jsonl").string();
  std::mt19937 rng(7);
  int lines_cut = 0;
  for (int round = 0; round < 60; ++round) {
    const pid_t child = ::fork();
    if (child == 0) {
      LineLog log(path, false, "log");
      for (int i = 0;; ++i) log.append(fmt::format("{{\"round\": {}, \"i\": {}, \"pad\": \"{}\"}}",
                                                   round, i, std::string(6000, 'x')));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % 3000));
    kill_and_reap(child);
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    char last = '\n';
    if (in.tellg() > 0) {
      in.seekg(-1, std::ios::end);
      in.get(last);
    }
    if (last != '\n') ++lines_cut;  // a kill inside write(2)
  }
  { LineLog last(path, false, "log"); }  // cuts a partial last line
  std::ifstream in(path);
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    ASSERT_TRUE(line.starts_with("{\"round\": ") && line.ends_with("\"}")) << "line " << lines;
  }
  EXPECT_GT(lines, 0);
  std::printf("%d lines; %d of 60 kills cut a last line (cut off by the next writer)\n", lines,
              lines_cut);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace meshtrain
