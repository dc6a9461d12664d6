#include "meshtrain/train/trace_hook.h"

#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/ranges.h>

#include "meshtrain/util/error.h"

namespace meshtrain {

namespace fs = std::filesystem;

namespace {

int64_t parse_step(const std::string& spec, std::string_view text) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  MESHTRAIN_CHECK_AS(ErrorKind::config,
                     ec == std::errc() && end == text.data() + text.size() && value >= 1,
                     "config: train.trace_steps must be \"A-B\" or \"N\" with steps from 1, got "
                     "\"{}\"",
                     spec);
  return value;
}

int64_t nanos(auto time_point) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(time_point.time_since_epoch())
      .count();
}

// The members of this rank's group along one axis, in communicator rank order.
// The group's name and its members' world ranks: the coordinates `me` shares
// with them, `axes` running (the first slowest).
std::string group_name(const Communicator& comm, const MeshLayout& layout, MeshCoord me,
                       std::initializer_list<std::pair<int MeshCoord::*, int>> axes) {
  std::vector<int> members{layout.rank(me)};
  for (const auto& [axis, size] : axes) {
    std::vector<int> grown;
    for (int rank : members) {
      for (int k = 0; k < size; ++k) {
        MeshCoord c = layout.coord(rank);
        c.*axis = k;
        grown.push_back(layout.rank(c));
      }
    }
    members = std::move(grown);
  }
  return fmt::format("{}[{}]", comm.name(), fmt::join(members, ","));
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  MESHTRAIN_CHECK_AS(ErrorKind::io, out.good(), "trace: cannot write '{}'", path);
}

// Point to point, as int32 words (the communicator moves no bytes type).
void send_text(Communicator& comm, const std::string& text, int peer) {
  int64_t size = static_cast<int64_t>(text.size());
  comm.send(&size, 1, CommDType::i64, peer);
  std::vector<int32_t> words(static_cast<size_t>((size + 3) / 4), 0);
  std::memcpy(words.data(), text.data(), text.size());
  comm.send(words.data(), static_cast<int64_t>(words.size()), CommDType::i32, peer);
}

std::string recv_text(Communicator& comm, int peer) {
  int64_t size = 0;
  comm.recv(&size, 1, CommDType::i64, peer);
  std::vector<int32_t> words(static_cast<size_t>((size + 3) / 4), 0);
  comm.recv(words.data(), static_cast<int64_t>(words.size()), CommDType::i32, peer);
  return std::string(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(size));
}

}  // namespace

std::pair<int64_t, int64_t> parse_trace_steps(const std::string& spec) {
  const size_t dash = spec.find('-');
  if (dash == std::string::npos) {
    const int64_t n = parse_step(spec, spec);
    return {n, n};
  }
  const int64_t a = parse_step(spec, std::string_view(spec).substr(0, dash));
  const int64_t b = parse_step(spec, std::string_view(spec).substr(dash + 1));
  MESHTRAIN_CHECK_AS(ErrorKind::config, a <= b,
                     "config: train.trace_steps \"{}\": the first step is after the last", spec);
  return {a, b};
}

std::string TraceHook::rank_file(const std::string& out_dir, int rank) {
  return (fs::path(out_dir) / "trace" / fmt::format("rank_{}.json", rank)).string();
}

std::string TraceHook::merged_file(const std::string& out_dir) {
  return (fs::path(out_dir) / "trace" / "merged.json").string();
}

TraceHook::TraceHook(const std::string& steps, std::string out_dir, DeviceMesh* mesh)
    : out_dir_(std::move(out_dir)), mesh_(mesh) {
  std::tie(first_, last_) = parse_trace_steps(steps);
  trace::set_thread_name("main");
  if (mesh_ != nullptr) {
    rank_ = mesh_->rank();
    world_size_ = mesh_->size();
    mesh_->world().barrier();
  }
  epoch_ = trace::Clock::now();
  int64_t mine[2] = {nanos(epoch_), nanos(std::chrono::system_clock::now())};
  epochs_.assign(mine, mine + 2);
  if (mesh_ != nullptr) {
    epochs_.assign(static_cast<size_t>(2 * world_size_), 0);
    std::vector<int64_t> counts(static_cast<size_t>(world_size_), 2);
    mesh_->world().all_gather(mine, epochs_.data(), counts, CommDType::i64);
    const MeshLayout& layout = mesh_->layout();
    const MeshCoord me = mesh_->coord();
    std::vector<int> all(static_cast<size_t>(world_size_));
    for (int r = 0; r < world_size_; ++r) all[static_cast<size_t>(r)] = r;
    comms_.push_back({&mesh_->world(),
                      fmt::format("{}[{}]", mesh_->world().name(), fmt::join(all, ",")), 0, 0});
    auto add = [&](Communicator& comm, std::initializer_list<std::pair<int MeshCoord::*, int>> axes) {
      comms_.push_back({&comm, group_name(comm, layout, me, axes), 0, 0});
    };
    add(mesh_->replicas(), {{&MeshCoord::dp, layout.dp()}, {&MeshCoord::cp, layout.cp()}});
    if (layout.cp() > 1) add(mesh_->cp(), {{&MeshCoord::cp, layout.cp()}});
    add(mesh_->tp(), {{&MeshCoord::tp, layout.tp()}});
    add(mesh_->pp(), {{&MeshCoord::pp, layout.pp()}});
  }
}

void TraceHook::before_step(int64_t step) {
  if (step == first_ && !written_) {
    for (CommWindow& c : comms_) c.seq_begin = c.comm->calls_issued();
    trace::start(epoch_);
    active_ = true;
  } else if (active_ && step == last_ + 1) {
    finish_window();
  }
}

void TraceHook::on_end() {
  if (active_) finish_window();
}

std::string TraceHook::other_json() const {
  std::vector<std::string> comms;
  for (const CommWindow& c : comms_) {
    comms.push_back(fmt::format(R"({{"group":{},"seq_begin":{},"seq_end":{}}})",
                                trace::quote(c.group), c.seq_begin, c.seq_end));
  }
  std::string coord = "null";
  if (mesh_ != nullptr) {
    const MeshCoord c = mesh_->coord();
    coord = fmt::format(R"({{"dp":{},"cp":{},"tp":{},"pp":{}}})", c.dp, c.cp, c.tp, c.pp);
  }
  return fmt::format(
      R"({{"rank":{},"world_size":{},"coord":{},"steps":[{},{}],"clock":{{"aligned_by":"barrier","steady_epoch_ns":{},"system_epoch_ns":{}}},"comms":[{}]}})",
      rank_, world_size_, coord, first_, last_, epochs_[2 * static_cast<size_t>(rank_)],
      epochs_[2 * static_cast<size_t>(rank_) + 1], fmt::join(comms, ","));
}

void TraceHook::finish_window() {
  trace::stop();
  active_ = false;
  written_ = true;
  for (CommWindow& c : comms_) c.seq_end = c.comm->calls_issued();
  const std::string body =
      trace::events_json(rank_, fmt::format("rank {}", rank_), trace::take());
  fs::create_directories(fs::path(out_dir_) / "trace");
  const std::string other = other_json();
  write_text(rank_file(out_dir_, rank_), trace::file_json({body}, other));

  // The merge: every rank's events (and otherData) to rank 0, in rank order.
  if (mesh_ != nullptr && rank_ != 0) {
    send_text(mesh_->world(), other, 0);
    send_text(mesh_->world(), body, 0);
    return;
  }
  std::vector<std::string> bodies{body}, others{other};
  for (int r = 1; r < world_size_; ++r) {
    others.push_back(recv_text(mesh_->world(), r));
    bodies.push_back(recv_text(mesh_->world(), r));
  }
  std::vector<std::string> offsets;
  for (int r = 0; r < world_size_; ++r) {
    const size_t i = static_cast<size_t>(r);
    offsets.push_back(fmt::format(
        R"({{"rank":{},"steady_epoch_ns":{},"system_epoch_ns":{},"system_offset_ns":{}}})", r,
        epochs_[2 * i], epochs_[2 * i + 1], epochs_[2 * i + 1] - epochs_[1]));
  }
  const std::string merged_other = fmt::format(
      R"({{"world_size":{},"steps":[{},{}],"clock":{{"aligned_by":"barrier","note":"each rank's ts is relative to its own epoch, taken as it left one barrier; system_offset_ns = its system clock at the epoch minus rank 0's","ranks":[{}]}},"ranks":[{}]}})",
      world_size_, first_, last_, fmt::join(offsets, ","), fmt::join(others, ","));
  write_text(merged_file(out_dir_), trace::file_json(bodies, merged_other));
}

}  // namespace meshtrain
