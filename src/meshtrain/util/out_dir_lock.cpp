#include "meshtrain/util/out_dir_lock.h"

#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

// A rank waits this long for a lock another taker holds for a moment only
// (a conversion, launch's probe) before it gives up: never forever.
constexpr double kMomentS = 5.0;

FileLock open_lock(const std::string& out_dir, const char* name) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  MESHTRAIN_CHECK_AS(ErrorKind::io, !ec, "cannot create train.out_dir '{}': {}", out_dir,
                     ec.message());
  return FileLock((fs::path(out_dir) / name).string());
}

[[noreturn]] void refuse(const std::string& out_dir, const FileLock& lock, const char* what) {
  const std::string holder = lock.holder();
  fail_as(ErrorKind::busy,
          "train.out_dir '{}' is in use by {} ({}; lock {}): wait for it to end or choose "
          "another out_dir",
          out_dir, what, holder.empty() ? "holder unknown" : holder, lock.path());
}

std::string no_locks(const std::string& out_dir, const FileLock& lock) {
  return fmt::format("warning: train.out_dir '{}' is on a file system without locks ({}: {}): "
                     "nothing keeps a second run out of it",
                     out_dir, lock.path(), std::strerror(lock.error()));
}

// Takes out_dir/`name` exclusively, waiting up to `wait_s` for another holder
// to let go, and writes `holder` into it; refuses (busy, naming `other`) when
// another still holds it; false, with the warning and nothing held, where the
// file system has no locks.
bool take_exclusive(const std::string& out_dir, const char* name, const char* holder,
                    const char* other, double wait_s, FileLock* lock, std::string* warning) {
  *lock = open_lock(out_dir, name);
  const FileLock::Result r = lock->lock_within(FileLock::Mode::exclusive, wait_s);
  if (r == FileLock::Result::held) refuse(out_dir, *lock, other);
  if (r == FileLock::Result::unsupported) {
    *warning = no_locks(out_dir, *lock);
    *lock = FileLock();
    return false;
  }
  lock->write_holder(holder);
  return true;
}

}  // namespace

OutDirLocks lock_out_dir(const std::string& out_dir, bool under_launch, std::string* warning) {
  OutDirLocks locks;
  if (!under_launch && !take_exclusive(out_dir, "owner.lock", "meshtrain train", "another run",
                                       0, &locks.owner, warning)) {
    return {};
  }
  // The ranks of a job that has just ended in this out_dir may still be
  // unwinding (another Trainer in the same processes, a slow exit): a moment.
  if (!take_exclusive(out_dir, "ranks.lock", "started by meshtrain train",
                      "ranks of an earlier job", kMomentS, &locks.ranks, warning)) {
    return {};
  }
  // No rank of an earlier job is left; from here this job's ranks share it.
  if (locks.ranks.lock_within(FileLock::Mode::shared, kMomentS) != FileLock::Result::locked) {
    refuse(out_dir, locks.ranks, "another run");
  }
  return locks;
}

FileLock join_out_dir(const std::string& out_dir) {
  FileLock ranks = open_lock(out_dir, "ranks.lock");
  const FileLock::Result r = ranks.lock_within(FileLock::Mode::shared, kMomentS);
  if (r == FileLock::Result::held) refuse(out_dir, ranks, "another run");
  return r == FileLock::Result::locked ? std::move(ranks) : FileLock();
}

FileLock lock_launch(const std::string& out_dir, std::string* warning) {
  FileLock owner;
  take_exclusive(out_dir, "owner.lock", "meshtrain launch", "another run", 0, &owner, warning);
  return owner;
}

std::string wait_out_dir_free(const std::string& out_dir, double seconds) {
  const fs::path path = fs::path(out_dir) / "ranks.lock";
  if (!fs::exists(path)) return {};
  FileLock ranks(path.string());
  if (ranks.lock_within(FileLock::Mode::exclusive, seconds) != FileLock::Result::held) return {};
  const std::string holder = ranks.holder();
  return holder.empty() ? "holder unknown" : holder;
}

}  // namespace meshtrain
