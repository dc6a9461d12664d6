// Saving: each rank's file, the commit protocol through the filesystem,
// retention, and choosing the checkpoint to resume from.
#include "meshtrain/ckpt/distributed.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/dist_internal.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain::dist_ckpt {
namespace detail {

namespace fs = std::filesystem;
using layout::ShardPiece;
using layout::StateKind;

void fault_point(const char* point, int64_t step) {
  const char* want = std::getenv("MESHTRAIN_CKPT_FAULT");
  if (want == nullptr) return;
  // POINT[@STEP][:pause=SECONDS]: SIGKILL there, or a pause (a slow rank).
  std::string spec(want);
  double pause_s = -1;
  if (const size_t colon = spec.find(":pause="); colon != spec.npos) {
    pause_s = std::atof(spec.c_str() + colon + 7);
    spec.resize(colon);
  }
  const size_t at = spec.find('@');
  if (spec.substr(0, at) != point) return;
  if (at != spec.npos && spec.substr(at + 1) != std::to_string(step)) return;
  if (pause_s >= 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(pause_s));
    return;
  }
  ::kill(::getpid(), SIGKILL);
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MESHTRAIN_CHECK_AS(ErrorKind::io, fd >= 0, "{}: cannot open directory: {}", dir,
                     std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some filesystems cannot fsync a directory; their rename is then as durable as it gets.
  MESHTRAIN_CHECK_AS(ErrorKind::io, rc == 0 || err == EINVAL || err == EROFS,
                     "{}: fsync failed: {}", dir, std::strerror(err));
}

RankRecord write_rank_file(const std::string& dir, int rank, int64_t step,
                           const layout::ShardMap& map, layout::StateAccess& state,
                           int64_t buffer_bytes, MemoryTracker& tracker, const float* staged,
                           const Allocator& allocator) {
  RankRecord record;
  record.rank = rank;
  std::vector<bool> seen(map.tensors.size(), false);
  std::vector<const ShardPiece*> owned;
  std::vector<int> ordinal;         // k in "<state>/<name>#<k>"
  std::map<size_t, int> pieces_of;  // per tensor, so far
  for (const ShardPiece& p : map.pieces) {
    if (!seen[p.tensor]) record.held.push_back(map.tensors[p.tensor]);
    seen[p.tensor] = true;
    if (p.replica != 0) continue;
    owned.push_back(&p);
    ordinal.push_back(pieces_of[p.tensor]++);
  }
  if (owned.empty()) return record;

  record.file = rank_file_name(rank);
  std::vector<SafetensorsStreamWriter::Entry> entries;
  uint64_t total = 0;
  for (size_t k = 0; k < layout::kStateKinds; ++k) {
    const auto kind = static_cast<StateKind>(k);
    for (size_t i = 0; i < owned.size(); ++i) {
      const layout::GlobalTensor& t = map.tensors[owned[i]->tensor];
      if (!t.states.has(kind)) continue;  // a frozen tensor's moments: none
      PieceRecord piece{t.name, t.shape, {}};
      piece.shard = ManifestShard{
          record.file, fmt::format("{}/{}#{}", layout::state_kind_name(kind), t.name, ordinal[i]),
          kind, owned[i]->region};
      entries.push_back({piece.shard.key, StDType::F32, {owned[i]->region.numel()}});
      total += static_cast<uint64_t>(owned[i]->region.numel()) * 4;
      record.pieces.push_back(std::move(piece));
    }
  }
  const std::map<std::string, std::string> metadata = {
      {"format", kFormat}, {"rank", std::to_string(rank)}, {"step", std::to_string(step)}};
  SafetensorsStreamWriter writer(join(dir, record.file), entries, metadata);
  bool halfway = false;
  auto write_data = [&](const float* data, int64_t count) {
    writer.write(data, static_cast<size_t>(count) * 4);
    if (!halfway && writer.data_written() * 2 >= writer.data_bytes()) {
      halfway = true;
      fault_point("mid_file", step);
    }
  };
  const auto total_floats = static_cast<int64_t>(total / 4);
  if (staged != nullptr) {
    // The async staging copy is the data section already: no buffer.
    // Chunks of whole 4096-byte units from the page-aligned copy: direct writes.
    const int64_t chunk =
        std::max<int64_t>(1, std::min((buffer_bytes / 4096) * 1024, total_floats));
    for (int64_t done = 0; done < total_floats; done += chunk) {
      write_data(staged + done, std::min(chunk, total_floats - done));
    }
  } else {
    const Tensor buffer = file_buffer(buffer_bytes, total, tracker, allocator);
    // Two halves: one is filled from the state while the other is written
    // (in whole 4096-byte units when the buffer is big enough: direct writes).
    int64_t capacity = buffer.numel();
    const bool halves = capacity >= 2048;
    if (halves) capacity = capacity / 2 / 1024 * 1024;
    float* const half[2] = {buffer.data<float>(), buffer.data<float>() + (halves ? capacity : 0)};
    std::future<void> pending;
    auto finish_pending = [&] {
      if (pending.valid()) pending.get();  // rethrows the write's error
    };
    int side = 0;
    int64_t filled = 0;
    // Pieces packed into the buffer back to back: one write per full half.
    for (size_t k = 0; k < layout::kStateKinds; ++k) {
      for (const ShardPiece* p : owned) {
        if (!map.tensors[p->tensor].states.has(static_cast<StateKind>(k))) continue;
        for (int64_t begin = 0; begin < p->region.numel();) {
          const int64_t n = std::min(p->region.numel() - begin, capacity - filled);
          state.read(static_cast<StateKind>(k), p->local_offset + begin, n, half[side] + filled);
          filled += n;
          begin += n;
          if (filled < capacity) continue;
          finish_pending();
          if (halves) {
            pending = std::async(std::launch::async, write_data, half[side], filled);
            side = 1 - side;
          } else {
            write_data(half[side], filled);
          }
          filled = 0;
        }
      }
    }
    finish_pending();
    if (filled > 0) write_data(half[side], filled);
  }
  writer.commit();
  record.bytes = writer.file_bytes();
  record.xxh3 = writer.checksum();
  return record;
}

}  // namespace detail

uint64_t save_workspace_bytes(int64_t owned_states, int64_t buffer_bytes, bool async) {
  if (async) return static_cast<uint64_t>(std::max<int64_t>(owned_states, 1)) * 4;
  if (owned_states == 0) return 0;
  return detail::file_buffer_bytes(buffer_bytes, static_cast<uint64_t>(owned_states) * 4);
}

namespace {

namespace fs = std::filesystem;
using namespace detail;
using Clock = std::chrono::steady_clock;

const std::regex kStepDir(R"(step_(\d+))");
// Killed saves' directories and a killed rewrite of `latest` (AtomicFile's temporary).
const std::regex kLeftover(R"(step_\d+\.(tmp|trash)|latest\.tmp\.\d+)");
// A killed save's directory: step_<N>.tmp.
const std::regex kKilledSave(R"(step_(\d+)\.tmp)");

// Sleeps a little longer each time, up to 50 ms.
struct Poll {
  Clock::time_point deadline;
  std::chrono::microseconds pause{500};
  explicit Poll(double timeout_s)
      : deadline(Clock::now() + std::chrono::microseconds(
                                    static_cast<int64_t>(std::clamp(timeout_s, 0.0, 1e9) * 1e6))) {}
  bool expired() const { return Clock::now() > deadline; }
  void sleep() {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(50000));
  }
};

std::string make_save_id() {
  std::random_device device;
  uint64_t id = (uint64_t{device()} << 32) ^ device();
  id ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  id ^= static_cast<uint64_t>(::getpid()) << 17;
  return hex64(id);
}

// The save id in `path` (open.json or a manifest), nullopt when absent or unreadable.
std::optional<std::string> save_id_in(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  try {
    const json value = read_json_file(path);
    if (value.is_object() && value.contains("save_id") && value["save_id"].is_string()) {
      return value["save_id"].get<std::string>();
    }
  } catch (const Error&) {
  }
  return std::nullopt;
}

void remove_dir(const fs::path& dir) {
  // Another process may still add a file while we remove (a rank that read a
  // stale open.json); try again before giving up.
  for (int attempt = 0;; ++attempt) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (!ec) return;
    MESHTRAIN_CHECK(attempt < 5, "{}: cannot remove: {}", dir.string(), ec.message());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Removes out_dir/name, a directory of step `step`, by renaming it to
// step_<step>.trash first (a leftover of that name removed before), so under its own name the directory is whole or
// gone at every instant: a crash mid-removal leaves nothing that looks
// committed, and a rank still writing into it never sees it half removed.
void retire_dir(const std::string& out_dir, const std::string& name, int64_t step) {
  const std::string aside = join(out_dir, step_name(step) + ".trash");
  remove_dir(aside);
  MESHTRAIN_CHECK_AS(ErrorKind::io,
                     ::rename(join(out_dir, name).c_str(), aside.c_str()) == 0 || errno == ENOENT,
                     "{}: cannot retire {}: {}", out_dir, name, std::strerror(errno));
  fault_point("retire", step);
  remove_dir(aside);
}

// Leftovers of killed saves: never read, removed. A killed save's step_N.tmp
// is retired: a rank that followed its stale open.json may still be writing
// there. Removed in place, that rank could see its own file vanish while the
// stale open.json was still there, take that for a failure of the current
// save and give up.
void remove_leftovers(const std::string& out_dir) {
  std::error_code ec;
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(out_dir, ec)) {
    std::string name = entry.path().filename().string();
    if (std::regex_match(name, kLeftover)) found.push_back(std::move(name));
  }
  for (const std::string& name : found) {
    std::smatch m;
    if (std::regex_match(name, m, kKilledSave)) {
      retire_dir(out_dir, name, std::stoll(m[1].str()));
    } else {
      remove_dir(join(out_dir, name));
    }
  }
}

// The step_<N> directories of out_dir (committed: renamed into place), oldest first.
std::vector<std::pair<int64_t, std::string>> committed_steps(const std::string& out_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(out_dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (std::regex_match(name, m, kStepDir) && entry.is_directory(ec)) {
      out.emplace_back(std::stoll(m[1].str()), name);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_latest(const std::string& out_dir) {
  std::ifstream in(join(out_dir, kLatestFile));
  std::string name;
  if (in.good()) std::getline(in, name);
  return name;
}

// Moves `tmp` to `final`; when `final` exists (the same step saved again) the
// two are swapped atomically, so `final` is valid at every instant.
void install(const std::string& tmp, const std::string& final_dir) {
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    MESHTRAIN_CHECK_AS(ErrorKind::io, ::rename(tmp.c_str(), final_dir.c_str()) == 0,
                       "{}: rename to {} failed: {}", tmp, final_dir, std::strerror(errno));
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    remove_dir(tmp);  // now the old checkpoint
    return;
  }
  MESHTRAIN_CHECK_AS(ErrorKind::io, errno == EINVAL || errno == ENOSYS || errno == ENOTSUP,
                     "{}: exchange with {} failed: {}", tmp, final_dir, std::strerror(errno));
  const std::string trash = final_dir + ".trash";
  remove_dir(trash);
  MESHTRAIN_CHECK_AS(ErrorKind::io, ::rename(final_dir.c_str(), trash.c_str()) == 0,
                     "{}: rename to {} failed: {}", final_dir, trash, std::strerror(errno));
  MESHTRAIN_CHECK_AS(ErrorKind::io, ::rename(tmp.c_str(), final_dir.c_str()) == 0,
                     "{}: rename to {} failed: {}", tmp, final_dir, std::strerror(errno));
  remove_dir(trash);
}

// keep_last: the oldest committed checkpoints beyond `keep`, never the one
// `latest` names, retired (retire_dir).
void apply_retention(const std::string& out_dir, int keep) {
  if (keep <= 0) return;
  const std::string latest = read_latest(out_dir);
  std::vector<std::pair<int64_t, std::string>> sharded;
  for (const auto& entry : committed_steps(out_dir)) {
    if (is_sharded_checkpoint(join(out_dir, entry.second))) sharded.push_back(entry);
  }
  size_t excess = sharded.size() > static_cast<size_t>(keep) ? sharded.size() - keep : 0;
  for (size_t i = 0; i < sharded.size() && excess > 0; ++i) {
    const auto& [step, name] = sharded[i];
    if (name == latest) continue;
    retire_dir(out_dir, name, step);
    --excess;
  }
}

// A StateAccess over the async save's staging copy, which is the rank file's
// data section: state by state, the owned pieces that have the state in map
// order. `packed` places the owned pieces back to back (local offsets 0..n);
// each state's segments map those offsets into the copy.
class StagedState : public layout::StateAccess {
 public:
  StagedState(const layout::ShardMap& packed, Tensor staging) : staging_(std::move(staging)) {
    int64_t at = 0;
    for (size_t k = 0; k < layout::kStateKinds; ++k) {
      for (const ShardPiece& p : packed.pieces) {
        if (p.replica != 0 || !packed.tensors[p.tensor].states.has(static_cast<StateKind>(k))) {
          continue;
        }
        segments_[k].push_back({p.local_offset, p.region.numel(), at});
        at += p.region.numel();
      }
    }
    MESHTRAIN_CHECK(at <= staging_.numel(), "internal: staging copy of {} floats for {}",
                    staging_.numel(), at);
  }
  void read(StateKind kind, int64_t local_offset, int64_t count, float* out) override {
    const float* src = data(kind, local_offset, count);
    std::copy(src, src + count, out);
  }
  void write(StateKind, int64_t, int64_t, const float*) override {
    fail("internal: the staged copy of a checkpoint is read-only");
  }
  const float* file_data() const { return staging_.data<float>(); }
  // Where elements [local_offset, +count) of `kind` (within one owned piece) are staged.
  float* data(StateKind kind, int64_t local_offset, int64_t count) {
    const std::vector<Segment>& segs = segments_[static_cast<size_t>(kind)];
    auto it = std::upper_bound(segs.begin(), segs.end(), local_offset,
                               [](int64_t v, const Segment& s) { return v < s.local_offset; });
    MESHTRAIN_CHECK(it != segs.begin() && local_offset + count <= std::prev(it)->local_offset +
                                                                     std::prev(it)->count,
                    "internal: staged {} [{}, {}) outside the owned pieces",
                    layout::state_kind_name(kind), local_offset, local_offset + count);
    --it;
    return staging_.data<float>() + it->at + (local_offset - it->local_offset);
  }

 private:
  struct Segment {
    int64_t local_offset, count, at;
  };
  Tensor staging_;
  std::vector<Segment> segments_[layout::kStateKinds];
};

struct SaveContext {
  const std::string& out_dir;
  const SaveOptions& options;
  MemoryTracker& tracker;
  const float* staged = nullptr;  // async: the owned state in file order
};

// This rank's file and done file in `tmp`, under save id `id`.
RankRecord write_and_mark(const SaveContext& ctx, const std::string& tmp, int64_t step,
                          const std::string& id, const layout::ShardMap& map,
                          layout::StateAccess& state) {
  fault_point("before_file", step);
  RankRecord record = write_rank_file(
      tmp, ctx.options.rank, step, map, state, ctx.options.buffer_bytes, ctx.tracker, ctx.staged,
      ctx.options.staging_memory());
  record.world = ctx.options.world;
  fault_point("after_file", step);
  write_json_atomic(join(tmp, done_file_name(ctx.options.rank)),
                    rank_record_json(record, step, id));
  fault_point("after_done", step);
  fsync_dir(tmp);  // rank 0 may have committed and renamed tmp by now (save_other)
  return record;
}

// Rank 0: every other rank's record of save `id`, waiting for their done files.
std::vector<RankRecord> gather_records(const SaveContext& ctx, const std::string& tmp, int64_t step,
                                       const std::string& id, RankRecord mine) {
  std::vector<RankRecord> records(static_cast<size_t>(ctx.options.world));
  std::set<int> missing;
  for (int r = 1; r < ctx.options.world; ++r) missing.insert(r);
  records[0] = std::move(mine);
  Poll poll(ctx.options.commit_timeout_s);
  while (!missing.empty()) {
    for (auto it = missing.begin(); it != missing.end();) {
      const std::string path = join(tmp, done_file_name(*it));
      // A done file of another save id is a rank that read a stale open.json: it will redo.
      if (save_id_in(path) != id) {
        ++it;
        continue;
      }
      RankRecord record = rank_record_from_json(read_json_file(path), path);
      MESHTRAIN_CHECK(record.rank == *it, "{}: names rank {}", path, record.rank);
      MESHTRAIN_CHECK(record.world == ctx.options.world,
                      "{}: rank {} saves with world {}, rank 0 with world {}", path, record.rank,
                      record.world, ctx.options.world);
      records[static_cast<size_t>(*it)] = std::move(record);
      it = missing.erase(it);
    }
    if (missing.empty()) break;
    if (poll.expired()) {
      std::string names;
      for (int r : missing) names += fmt::format("{}{}", names.empty() ? "" : ", ", r);
      fail("{}: ranks {} did not finish writing within {} s (no {} of save {})", tmp, names,
           ctx.options.commit_timeout_s, done_file_name(*missing.begin()), id);
    }
    poll.sleep();
  }
  return records;
}

std::string save_rank0(const SaveContext& ctx, int64_t step, const layout::ShardMap& map,
                       layout::StateAccess& state, const json& layout_json, const json& meta) {
  const std::string& out = ctx.out_dir;
  const std::string final_dir = join(out, step_name(step));
  const std::string tmp = final_dir + ".tmp";
  fs::create_directories(out);
  remove_leftovers(out);
  fs::create_directories(tmp);
  const std::string id = make_save_id();
  write_json_atomic(join(tmp, kOpenFile), json{{"step", step}, {"save_id", id}});
  fsync_dir(tmp);
  fsync_dir(out);

  try {
    RankRecord mine = write_and_mark(ctx, tmp, step, id, map, state);
    const std::vector<RankRecord> records = gather_records(ctx, tmp, step, id, std::move(mine));

    fault_point("before_manifest", step);
    std::vector<ManifestFile> carried;
    for (const std::string& path : ctx.options.carried_files) carried.push_back(carry_file(path, tmp));
    write_manifest(tmp, manifest_json(step, id, layout_json, meta, records, carried));
    for (int r = 0; r < ctx.options.world; ++r) fs::remove(join(tmp, done_file_name(r)));
    fs::remove(join(tmp, kOpenFile));
    fsync_dir(tmp);
  } catch (const std::exception& e) {
    // The other ranks wait for this save's commit: tell them now, not at their timeout.
    try {
      write_json_atomic(join(tmp, kFailedFile), json{{"save_id", id}, {"error", e.what()}});
    } catch (const std::exception&) {
    }
    throw;
  }

  fault_point("before_rename", step);
  install(tmp, final_dir);
  fsync_dir(out);

  fault_point("before_latest", step);
  write_file_atomic(join(out, kLatestFile), step_name(step) + "\n");
  fsync_dir(out);
  apply_retention(out, ctx.options.keep_last);
  return final_dir;
}

// Ranks > 0: write under rank 0's open.json, then wait until the manifest of
// that save id is committed. A stale open.json (a killed save's) is replaced
// by rank 0 with a new id; then the file is written again under it.
std::string save_other(const SaveContext& ctx, int64_t step, const layout::ShardMap& map,
                       layout::StateAccess& state) {
  const std::string final_dir = join(ctx.out_dir, step_name(step));
  const std::string tmp = final_dir + ".tmp";
  const std::string open_path = join(tmp, kOpenFile);
  Poll poll(ctx.options.commit_timeout_s);
  for (;;) {
    std::optional<std::string> id;
    while (!(id = save_id_in(open_path))) {
      MESHTRAIN_CHECK(!poll.expired(), "{}: rank 0 did not open the save within {} s (no {})", tmp,
                      ctx.options.commit_timeout_s, kOpenFile);
      poll.sleep();
    }
    try {
      write_and_mark(ctx, tmp, step, *id, map, state);
    } catch (const std::exception&) {
      // Our done file was in, and rank 0 committed and renamed tmp before our
      // sync of it: the save is done (waiting for open.json here hung the rank).
      if (save_id_in(join(final_dir, kManifestFile)) == id) return final_dir;
      if (save_id_in(open_path) == id) throw;
      continue;  // rank 0 replaced the directory under us: write again
    }
    const std::string failed_path = join(tmp, kFailedFile);
    for (;;) {
      if (save_id_in(join(final_dir, kManifestFile)) == id) return final_dir;
      if (save_id_in(failed_path) == id) {
        const json failure = read_json_file(failed_path);
        fail("{}: rank 0 failed to commit: {}", tmp, failure.value("error", std::string("?")));
      }
      const std::optional<std::string> now = save_id_in(open_path);
      if (now && now != id) break;
      MESHTRAIN_CHECK(!poll.expired(), "{}: rank {} wrote {} but rank 0 did not commit within {} s",
                      tmp, ctx.options.rank, rank_file_name(ctx.options.rank),
                      ctx.options.commit_timeout_s);
      poll.sleep();
    }
  }
}

std::string run_save(const SaveContext& ctx, int64_t step, const layout::ShardMap& map,
                     layout::StateAccess& state, const json& layout_json, const json& meta) {
  trace::Span span("checkpoint", "checkpoint write", step);
  try {
    return ctx.options.rank == 0 ? save_rank0(ctx, step, map, state, layout_json, meta)
                                 : save_other(ctx, step, map, state);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("checkpoint {}: rank {}: {}", join(ctx.out_dir, step_name(step)), ctx.options.rank,
         e.what());
  }
}

}  // namespace

struct CheckpointSaver::Job {
  std::thread thread;
  std::atomic<bool> done{false};
  std::exception_ptr error;
  layout::ShardMap packed;  // the owned pieces at their places in the staging copy
  std::unique_ptr<StagedState> staged;
  json layout_json, meta;
};

CheckpointSaver::CheckpointSaver(std::string out_dir, SaveOptions options)
    : out_dir_(std::move(out_dir)), options_(options) {
  MESHTRAIN_CHECK(options_.world >= 1 && options_.rank >= 0 && options_.rank < options_.world,
                  "checkpoint {}: rank {} of world {}", out_dir_, options_.rank, options_.world);
  if (options_.tracker == nullptr) {
    own_tracker_ = std::make_unique<MemoryTracker>();
    options_.tracker = own_tracker_.get();
  }
}

CheckpointSaver::~CheckpointSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    fmt::print(stderr, "meshtrain: checkpoint save failed: {}\n", e.what());
  }
}

bool CheckpointSaver::pending() const { return job_ != nullptr && !job_->done.load(); }

void CheckpointSaver::wait() {
  if (job_ == nullptr) return;
  if (job_->thread.joinable()) job_->thread.join();
  const std::exception_ptr error = job_->error;
  job_.reset();
  if (error) std::rethrow_exception(error);
}

std::string CheckpointSaver::save(int64_t step, const layout::ShardMap& map,
                                  layout::StateAccess& state, const nlohmann::json& layout_json,
                                  const nlohmann::json& meta) {
  wait();
  MESHTRAIN_CHECK(step >= 0, "checkpoint {}: negative step {}", out_dir_, step);
  map.validate();
  const SaveContext ctx{out_dir_, options_, *options_.tracker};
  if (!options_.async) return run_save(ctx, step, map, state, layout_json, meta);

  auto job = std::make_unique<Job>();
  job->packed.tensors = map.tensors;
  int64_t owned = 0;
  for (const layout::ShardPiece& p : map.pieces) {
    layout::ShardPiece q = p;
    q.local_offset = p.replica == 0 ? owned : 0;
    owned += p.replica == 0 ? p.region.numel() : 0;
    job->packed.pieces.push_back(q);
  }
  job->packed.local_numel = owned;
  const int64_t staged = std::max<int64_t>(map.owned_state_numel(), 1);
  if (staging_.numel() != staged) {
    staging_ = Tensor();
    staging_ = Tensor({staged}, DType::f32, MemCategory::workspace, *options_.tracker,
                      options_.staging_memory());
  }
  job->staged = std::make_unique<StagedState>(job->packed, staging_);
  for (size_t k = 0; k < layout::kStateKinds; ++k) {
    const auto kind = static_cast<StateKind>(k);
    for (size_t i = 0; i < map.pieces.size(); ++i) {
      const layout::ShardPiece& p = map.pieces[i];
      if (p.replica != 0 || !map.tensors[p.tensor].states.has(kind)) continue;
      state.read(kind, p.local_offset, p.region.numel(),
                 job->staged->data(kind, job->packed.pieces[i].local_offset, p.region.numel()));
    }
  }
  job->layout_json = layout_json;
  job->meta = meta;
  Job* raw = job.get();
  job_ = std::move(job);
  raw->thread = std::thread([this, raw, step] {
    trace::set_thread_name("checkpoint writer");
    try {
      const SaveContext context{out_dir_, options_, *options_.tracker, raw->staged->file_data()};
      run_save(context, step, raw->packed, *raw->staged, raw->layout_json, raw->meta);
    } catch (...) {
      raw->error = std::current_exception();
    }
    raw->done = true;
  });
  return join(out_dir_, step_name(step));
}

std::optional<ResumeChoice> find_resume_checkpoint(const std::string& out_dir) {
  ResumeChoice choice;
  auto usable = [&](const std::string& name) {
    const std::string dir = join(out_dir, name);
    if (!is_sharded_checkpoint(dir)) {
      choice.notes.push_back(fmt::format("{}: skipped: no {} ({})", name, kManifestFile,
                                         is_legacy_checkpoint(dir)
                                             ? "a whole-tensor checkpoint; convert it first"
                                             : "not committed"));
      return false;
    }
    try {
      MemoryTracker tracker;
      for (const ManifestFile& f : read_manifest(dir).files) {
        if (f.name.starts_with("rank_")) {
          check_file_present(dir, f);
        } else {  // a small carried file, which no load reads
          verify_file(dir, f, file_buffer(1 << 20, f.bytes, tracker));
        }
      }
      return true;
    } catch (const Error& e) {
      choice.notes.push_back(fmt::format("{}: skipped: {}", name, e.what()));
      return false;
    }
  };
  std::vector<std::string> found;
  int64_t below = INT64_MAX;  // only checkpoints older than the one `latest` names
  const std::string latest = read_latest(out_dir);
  std::smatch m;
  if (!latest.empty()) {
    if (std::regex_match(latest, m, kStepDir)) {
      below = std::stoll(m[1].str());
      if (usable(latest)) {
        found.push_back(join(out_dir, latest));
      } else {
        choice.notes.back() = fmt::format("latest names {}", choice.notes.back());
      }
    } else {
      choice.notes.push_back(fmt::format("latest: '{}' is not a step directory name", latest));
    }
  }
  const auto steps = committed_steps(out_dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->first < below && usable(it->second)) found.push_back(join(out_dir, it->second));
  }
  if (found.empty()) return std::nullopt;
  choice.dir = found.front();
  choice.fallbacks.assign(found.begin() + 1, found.end());
  return choice;
}

}  // namespace meshtrain::dist_ckpt
