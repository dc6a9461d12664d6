// Distributed checkpoints under damage: corrupt, truncated and missing files
// are named; resume skips to the newest valid checkpoint; a process killed
// (SIGKILL) at random instants or at each named point of the commit protocol
// leaves `latest` naming a checkpoint that verifies and loads.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <iterator>
#include <random>
#include <regex>

#include "dist_layouts.h"
#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/ckpt/safetensors.h"
#include "util.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using namespace dist_test;
using testing::read_file;
using testing::scratch_dir;
using testing::write_file;

void flip_byte(const std::string& path, size_t offset) {
  std::string bytes = read_file(path);
  ASSERT_LT(offset, bytes.size()) << path;
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x20);
  write_file(path, bytes);
}

// Loads `dir` into the single-rank layout (which reads every file).
void load_single(const std::string& dir, bool verify = true) {
  const Layout l = single_layout(test_tensors());
  MemState state(l.ranks[0].local_numel);
  dist_ckpt::load_checkpoint(dir, l.ranks[0], state, 64 << 20, verify);
}

TEST(dist_ckpt_recovery, DamagedFilesAreNamed) {
  const std::string out = scratch_dir();
  const std::string dir = save_all(out, 1, tp_layout(test_tensors(), 2, 1));
  const std::string rank1 = dir + "/rank_1.safetensors";
  const std::string rank0 = dir + "/rank_0.safetensors";
  const std::string manifest = dir + "/manifest.json";
  const std::string rank1_bytes = read_file(rank1), rank0_bytes = read_file(rank0),
                    manifest_bytes = read_file(manifest);

  flip_byte(rank1, rank1_bytes.size() - 3);  // a data byte
  EXPECT_ERROR(dist_ckpt::verify_checkpoint(dir), "rank_1.safetensors", "corrupt");
  EXPECT_ERROR(load_single(dir), "rank_1.safetensors", "corrupt");
  load_single(dir, /*verify=*/false);  // the header is intact: only the checksum tells
  int failed = -1;
  const std::string text = dist_ckpt::describe_checkpoint(dir, true, &failed);
  EXPECT_EQ(failed, 1);
  EXPECT_NE(text.find("rank_1.safetensors: corrupt"), std::string::npos) << text;
  EXPECT_NE(text.find("verify: 1 file(s) FAILED"), std::string::npos) << text;
  write_file(rank1, rank1_bytes);

  write_file(rank0, rank0_bytes.substr(0, rank0_bytes.size() - 10));
  EXPECT_ERROR(dist_ckpt::verify_checkpoint(dir), "rank_0.safetensors", "truncated");
  EXPECT_ERROR(load_single(dir), "rank_0.safetensors", "truncated");
  write_file(rank0, rank0_bytes);

  fs::remove(rank1);
  EXPECT_ERROR(dist_ckpt::verify_checkpoint(dir), "rank_1.safetensors", "missing");
  EXPECT_ERROR(load_single(dir), "rank_1.safetensors", "missing");
  write_file(rank1, rank1_bytes);

  // A manifest edit that is still valid JSON: caught by the manifest's own checksum.
  std::string edited = manifest_bytes;
  const size_t at = edited.find("1234");
  ASSERT_NE(at, std::string::npos);
  edited[at + 3] = '5';
  write_file(manifest, edited);
  EXPECT_ERROR(dist_ckpt::verify_checkpoint(dir), "manifest.json", "corrupt");
  EXPECT_ERROR(load_single(dir), "manifest.json", "corrupt");
  flip_byte(manifest, manifest_bytes.size() / 2);
  EXPECT_ERROR(dist_ckpt::read_manifest(dir), "manifest.json", "corrupt");
  fs::remove(manifest);
  EXPECT_ERROR(dist_ckpt::read_manifest(dir), "manifest.json", "missing");
  write_file(manifest, manifest_bytes);

  dist_ckpt::verify_checkpoint(dir);
  load_single(dir);
}

TEST(dist_ckpt_recovery, ResumeSkipsToTheNewestValidCheckpoint) {
  const std::string out = scratch_dir();
  EXPECT_FALSE(dist_ckpt::find_resume_checkpoint(out).has_value());
  const Layout l = zero_layout(single_layout(test_tensors()), 2);
  for (int step : {1, 2, 3}) save_all(out, step, l);

  auto choice = dist_ckpt::find_resume_checkpoint(out);
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->dir, out + "/step_3");
  EXPECT_TRUE(choice->notes.empty());

  EXPECT_EQ(choice->fallbacks, (std::vector<std::string>{out + "/step_2", out + "/step_1"}));

  // A flipped byte is the load's to find (it reads every byte once); a
  // truncated or missing file is seen here.
  flip_byte(out + "/step_3/rank_1.safetensors", 100);
  choice = dist_ckpt::find_resume_checkpoint(out);
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->dir, out + "/step_3");
  const std::string rank1 = out + "/step_3/rank_1.safetensors";
  std::string bytes = read_file(rank1);
  bytes.pop_back();
  write_file(rank1, bytes);
  choice = dist_ckpt::find_resume_checkpoint(out);
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->dir, out + "/step_2");
  EXPECT_EQ(choice->fallbacks, std::vector<std::string>{out + "/step_1"});
  ASSERT_EQ(choice->notes.size(), 1u);
  EXPECT_NE(choice->notes[0].find("latest names step_3"), std::string::npos) << choice->notes[0];
  EXPECT_NE(choice->notes[0].find("rank_1.safetensors: truncated"), std::string::npos)
      << choice->notes[0];

  // No latest (killed before it was written): the newest committed one that verifies.
  fs::remove(out + "/latest");
  fs::remove(out + "/step_2/manifest.json");
  choice = dist_ckpt::find_resume_checkpoint(out);
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->dir, out + "/step_1");
  EXPECT_TRUE(choice->fallbacks.empty());
  EXPECT_EQ(choice->notes.size(), 2u);

  write_file(out + "/latest", "step_7\n");  // names a directory that is gone
  choice = dist_ckpt::find_resume_checkpoint(out);
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->dir, out + "/step_1");
  EXPECT_NE(choice->notes[0].find("latest names step_7"), std::string::npos) << choice->notes[0];
}

// Bytes this process has read through read()/pread() (page cache hits included).
uint64_t bytes_read_so_far() {
  const std::string io = read_file("/proc/self/io");
  const size_t at = io.find("rchar: ");
  EXPECT_NE(at, std::string::npos) << io;
  return std::stoull(io.substr(at + 7));
}

// A verified load reads each file it needs once, checksumming the bytes as
// they go into the state; a flipped byte is found at the end of its file.
TEST(dist_ckpt_recovery, VerifiedLoadReadsEachFileOnce) {
  const std::string out = scratch_dir();
  const Layout l = zero_layout(single_layout(test_tensors(3000)), 2);  // ~2 MB per rank file
  const std::string dir = save_all(out, 3, l);
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(dir);
  uint64_t files = 0, headers = 0;
  for (const dist_ckpt::ManifestFile& f : m.files) {
    files += f.bytes;
    headers += SafetensorsReader(dir + "/" + f.name).data_start();
  }
  const Layout one_rank = single_layout(test_tensors(3000));
  const ShardMap& single = one_rank.ranks[0];
  MemState state(single.local_numel);
  const uint64_t before = bytes_read_so_far();
  uint64_t counted = 0;
  dist_ckpt::load_checkpoint(dir, single, state, 64 << 20, true, nullptr, &counted);
  const uint64_t read = bytes_read_so_far() - before;
  EXPECT_TRUE(matches_step(single, state, 3));
  // Every byte once, the headers once more (parsed, then hashed in the stream).
  EXPECT_EQ(counted, files + headers);
  EXPECT_GE(read, files);
  EXPECT_LE(read, files + headers + (64 << 10)) << "the manifest and little else besides";

  // Rank 1 of the same layout needs its own file only.
  MemState one(l.ranks[1].local_numel);
  uint64_t own = 0;
  dist_ckpt::load_checkpoint(dir, l.ranks[1], one, 64 << 20, true, nullptr, &own);
  EXPECT_EQ(own, m.find_file("rank_1.safetensors")->bytes +
                     SafetensorsReader(dir + "/rank_1.safetensors").data_start());
  EXPECT_TRUE(matches_step(l.ranks[1], one, 3));

  flip_byte(dir + "/rank_1.safetensors", m.find_file("rank_1.safetensors")->bytes / 2);
  MemState damaged(single.local_numel);
  uint64_t failed = 0;
  EXPECT_ERROR(dist_ckpt::load_checkpoint(dir, single, damaged, 64 << 20, true, nullptr, &failed),
               "rank_1.safetensors", "corrupt");
  EXPECT_EQ(failed, files + headers) << "a failed load counts what it read";
  MemState other(l.ranks[0].local_numel);
  dist_ckpt::load_checkpoint(dir, l.ranks[0], other);  // rank 0's file is whole
  EXPECT_TRUE(matches_step(l.ranks[0], other, 3));
}

// ---------------------------------------------------------------- crashes

// Runs `body` in a forked child (exit 0 when it returns, 2 on an exception);
// when `kill_after` is given, kills it with SIGKILL that long after the child
// created `ready` (timing from the fork would depend on the machine's load).
// Returns the wait status.
int run_child(const std::function<void()>& body,
              std::optional<std::chrono::microseconds> kill_after = std::nullopt,
              const std::string& ready = "") {
  const pid_t pid = ::fork();
  if (pid == 0) {
    try {
      body();
    } catch (const std::exception& e) {
      fmt::print(stderr, "child: {}\n", e.what());
      ::_exit(2);
    }
    ::_exit(0);
  }
  EXPECT_GT(pid, 0);
  if (kill_after) {
    for (int i = 0; i < 60000 && !ready.empty() && !fs::exists(ready); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(*kill_after);
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  return status;
}

// What a crash may leave: `latest` (if any) names a checkpoint that verifies
// and holds the values of its step; every committed step directory verifies.
void expect_recoverable(const std::string& out, const Layout& l) {
  const std::regex step_dir(R"(step_(\d+))");
  for (const auto& e : fs::directory_iterator(out)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, m, step_dir)) continue;
    EXPECT_NO_THROW(dist_ckpt::verify_checkpoint(e.path().string())) << name;
  }
  if (!fs::exists(out + "/latest")) return;
  std::string latest = read_file(out + "/latest");
  ASSERT_FALSE(latest.empty());
  latest.pop_back();
  const std::string dir = out + "/" + latest;
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(dir);
  EXPECT_EQ("step_" + std::to_string(m.step), latest);
  for (const ShardMap& map : l.ranks) {
    MemState state(map.local_numel);
    dist_ckpt::load_checkpoint(dir, map, state);
    EXPECT_TRUE(matches_step(map, state, m.step)) << latest;
  }
  auto choice = dist_ckpt::find_resume_checkpoint(out);
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->dir, dir);
}

// Two ranks (threads) saving steps first.. in a loop, keep_last 2.
void save_loop(const std::string& out, const Layout& l, int64_t first, int64_t last) {
  dist_ckpt::SaveOptions options;
  options.keep_last = 2;
  options.commit_timeout_s = 20;
  for (int64_t step = first; step <= last; ++step) {
    if (save_all(out, step, l, options).empty()) throw Error("save failed");
  }
}

TEST(dist_ckpt_recovery, KilledAtRandomInstantsLeavesAValidLatest) {
  const std::string out = scratch_dir();
  const Layout l = tp_layout(test_tensors(3000), 2, 1);  // ~0.7 M elements per state
  const Layout other = zero_layout(single_layout(test_tensors(3000)), 2);
  std::mt19937 rng(7);
  int64_t first = 1;
  int interrupted = 0, committed = 0;  // rounds killed inside a save; with a checkpoint
  for (int round = 0; round < 8; ++round) {
    const auto delay =
        std::chrono::microseconds(std::uniform_int_distribution<int>(0, 150000)(rng));
    const std::string ready = fmt::format("{}/ready{}", out, round);
    const int status = run_child(
        [&] {
          save_loop(out, l, first, first);  // one commit, then kill at random from here on
          write_file(ready, "");
          save_loop(out, l, first + 1, first + 1000);
        },
        delay, ready);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "round " << round;
    for (const auto& e : fs::directory_iterator(out)) {
      const std::string name = e.path().filename().string();
      interrupted += name.size() > 4 && name.substr(name.size() - 4) == ".tmp";
    }
    committed += fs::exists(out + "/latest");
    expect_recoverable(out, l);
    expect_recoverable(out, other);
    first += 3;  // a later run may save some of the same steps again
  }
  fmt::print("killed inside a save in {} of 8 rounds; latest present after {}\n", interrupted,
             committed);
  EXPECT_GT(interrupted, 0);
  EXPECT_GT(committed, 0);
  // A new run starts over: leftovers gone, and it commits.
  save_loop(out, l, 5000, 5000);
  for (const auto& e : fs::directory_iterator(out)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  EXPECT_EQ(read_file(out + "/latest"), "step_5000\n");
}

TEST(dist_ckpt_recovery, KilledAtEachPointOfTheProtocol) {
  const std::string root = scratch_dir();
  const Layout l = tp_layout(test_tensors(50), 2, 0);
  for (const char* point : {"before_file", "mid_file", "after_file", "before_manifest",
                            "before_rename", "before_latest"}) {
    SCOPED_TRACE(point);
    const std::string out = root + "/" + point;
    const int status = run_child([&] {
      save_loop(out, l, 1, 1);
      ::setenv("MESHTRAIN_CKPT_FAULT", fmt::format("{}@2", point).c_str(), 1);
      save_loop(out, l, 2, 2);
    });
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    EXPECT_EQ(read_file(out + "/latest"), "step_1\n");
    EXPECT_EQ(fs::exists(out + "/step_2"), std::string(point) == "before_latest");
    expect_recoverable(out, l);
    save_loop(out, l, 3, 3);
    EXPECT_FALSE(fs::exists(out + "/step_2.tmp"));
    EXPECT_EQ(read_file(out + "/latest"), "step_3\n");
    expect_recoverable(out, l);
  }
}

// A killed save's directory leaves its name before it is emptied, so a rank
// that followed its stale open.json finds it whole or gone, never half removed
// (CI once saw rank 1's file vanish while the stale open.json remained; rank 1
// took that for a failure of the current save and gave up). Rank 0, killed
// between the two, leaves it whole under another name.
TEST(dist_ckpt_recovery, AKilledSavesDirectoryIsMovedAsideBeforeItIsEmptied) {
  const std::string out = scratch_dir();
  const Layout l = single_layout(test_tensors(50));  // one rank: no one else writes step_2.tmp
  const std::string killed = out + "/step_2.tmp";
  fs::create_directories(killed);
  write_file(killed + "/open.json", R"({"step": 2, "save_id": "0123456789abcdef"})");
  constexpr int kFiles = 40;
  for (int i = 0; i < kFiles; ++i) write_file(fmt::format("{}/junk_{}", killed, i), "junk");
  const int status = run_child([&] {
    ::setenv("MESHTRAIN_CKPT_FAULT", "retire@2", 1);
    save_loop(out, l, 2, 2);
  });
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  EXPECT_FALSE(fs::exists(killed)) << "removed in place, not moved aside";
  const std::string aside = out + "/step_2.trash";
  ASSERT_TRUE(fs::is_directory(aside));
  EXPECT_EQ(std::distance(fs::directory_iterator(aside), fs::directory_iterator{}), kFiles + 1);
  save_loop(out, l, 2, 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_2"}));
}

}  // namespace
}  // namespace meshtrain
