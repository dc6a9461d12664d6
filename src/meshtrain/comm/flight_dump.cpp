#include "meshtrain/comm/flight_dump.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double ago(CommClock::time_point taken, CommClock::time_point t) {
  if (t == CommClock::time_point{}) return -1;
  return std::chrono::duration<double>(taken - t).count();
}

CallState parse_state(const std::string& name, const std::string& source) {
  for (CallState s : {CallState::queued, CallState::running, CallState::done, CallState::failed}) {
    if (name == call_state_name(s)) return s;
  }
  fail_as(ErrorKind::corrupt, "{}: unknown call state '{}'", source, name);
}

bool is_p2p(const std::string& op) { return op == "send" || op == "recv" || op == "send_recv"; }

// An integer field in T's range, else Error (corrupt). nlohmann's get<int>()
// casts a float unchecked: undefined behaviour past int's range.
template <typename T>
T whole(const json& v, const char* key, const std::string& source) {
  using limits = std::numeric_limits<T>;
  const bool fits =
      v.is_number_unsigned()  ? v.get<uint64_t>() <= static_cast<uint64_t>(limits::max())
      : v.is_number_integer() ? v.get<int64_t>() >= static_cast<int64_t>(limits::min()) &&
                                    (v.get<int64_t>() < 0 ||
                                     static_cast<uint64_t>(v.get<int64_t>()) <= static_cast<uint64_t>(limits::max()))
                              : false;
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, fits, "{}: field '{}' = {} is not an integer in range",
                     source, key, v.dump());
  return v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>()) : static_cast<T>(v.get<int64_t>());
}

std::string join(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) {
    if (!s.empty()) s += ',';
    s += std::to_string(r);
  }
  return s.empty() ? "none" : s;
}

}  // namespace

std::string flight_dump_json(const FlightSnapshot& s, const DumpInfo& info) {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  json comms = json::array();
  for (size_t i = 0; i < s.comms.size(); ++i) {
    comms.push_back({{"name", s.comms[i].name},
                     {"members", s.comms[i].members},
                     {"rank", s.comms[i].rank},
                     {"issued", s.progress[i].issued},
                     {"first_unfinished", s.progress[i].first_unfinished}});
  }
  json calls = json::array();
  for (const FlightEntry& e : s.calls) {
    calls.push_back({{"comm", e.comm},
                     {"seq", e.call.seq},
                     {"op", comm_op_name(e.call.op)},
                     {"dtype", comm_dtype_name(e.call.dtype)},
                     {"bytes", e.call.bytes},
                     {"peer", e.call.peer},
                     {"state", call_state_name(e.state)},
                     {"submitted_ago_s", ago(s.taken, e.call.submitted)},
                     {"started_ago_s", ago(s.taken, e.call.started)},
                     {"finished_ago_s", ago(s.taken, e.call.finished)},
                     {"timeout_s", e.timeout_s}});
  }
  json doc = {{"format", "meshtrain flight record 1"},
              {"job", info.job},
              {"rank", info.rank},
              {"world_size", info.world_size},
              {"reason", info.reason},
              {"host", std::string(host)},
              {"pid", static_cast<int>(::getpid())},
              {"marker_age_s", info.marker_age_s},
              {"comms", std::move(comms)},
              {"calls", std::move(calls)}};
  return doc.dump(1);
}

void write_flight_dump(const std::string& path, const std::string& json_text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << json_text << '\n';
    out.flush();
    MESHTRAIN_CHECK_AS(ErrorKind::io, out.good(), "flight record {}: write failed: {}", tmp,
                       std::strerror(errno));
  }
  MESHTRAIN_CHECK_AS(ErrorKind::io, ::rename(tmp.c_str(), path.c_str()) == 0,
                     "flight record {}: rename failed: {}", path, std::strerror(errno));
}

RankFlight parse_flight_dump(const std::string& text, const std::string& source) {
  RankFlight f;
  try {
    const json doc = json::parse(text);
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt,
                       doc.value("format", std::string()) == "meshtrain flight record 1",
                       "{}: not a meshtrain flight record", source);
    f.rank = whole<int>(doc.at("rank"), "rank", source);
    f.world_size = whole<int>(doc.at("world_size"), "world_size", source);
    f.job = doc.at("job").get<std::string>();
    f.reason = doc.at("reason").get<std::string>();
    f.host = doc.value("host", std::string());
    f.pid = doc.contains("pid") ? whole<int>(doc.at("pid"), "pid", source) : 0;
    f.marker_age_s = doc.value("marker_age_s", 0.0);
    for (const json& c : doc.at("comms")) {
      std::vector<int> members;
      MESHTRAIN_CHECK_AS(ErrorKind::corrupt, c.at("members").is_array(),
                         "{}: field 'members' is not an array", source);
      for (const json& m : c.at("members")) members.push_back(whole<int>(m, "members", source));
      f.comms.push_back({c.at("name").get<std::string>(), std::move(members),
                         whole<int>(c.at("rank"), "rank", source)});
      f.progress.push_back({whole<uint64_t>(c.at("issued"), "issued", source),
                            whole<uint64_t>(c.at("first_unfinished"), "first_unfinished", source)});
    }
    for (const json& c : doc.at("calls")) {
      DumpedCall d;
      d.comm = whole<int>(c.at("comm"), "comm", source);
      MESHTRAIN_CHECK_AS(ErrorKind::corrupt,
                         d.comm >= 0 && d.comm < static_cast<int>(f.comms.size()),
                         "{}: a call names communicator {} of {}", source, d.comm, f.comms.size());
      d.seq = whole<uint64_t>(c.at("seq"), "seq", source);
      d.op = c.at("op").get<std::string>();
      d.dtype = c.at("dtype").get<std::string>();
      d.bytes = whole<uint64_t>(c.at("bytes"), "bytes", source);
      d.peer = whole<int>(c.at("peer"), "peer", source);
      d.state = parse_state(c.at("state").get<std::string>(), source);
      d.submitted_ago_s = c.at("submitted_ago_s").get<double>();
      d.started_ago_s = c.at("started_ago_s").get<double>();
      d.finished_ago_s = c.at("finished_ago_s").get<double>();
      d.timeout_s = c.at("timeout_s").get<double>();
      f.calls.push_back(std::move(d));
    }
  } catch (const json::exception& e) {
    fail_as(ErrorKind::corrupt, "{}: malformed flight record: {}", source, e.what());
  }
  return f;
}

std::string flight_dump_name(int rank) { return fmt::format("rank_{}.json", rank); }

std::vector<RankFlight> read_flight_dumps(const std::string& dir) {
  std::vector<RankFlight> dumps;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("rank_") || !name.ends_with(".json")) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    dumps.push_back(parse_flight_dump(text.str(), entry.path().string()));
  }
  MESHTRAIN_CHECK_AS(ErrorKind::io, !ec, "flight records: cannot read {}: {}", dir, ec.message());
  std::sort(dumps.begin(), dumps.end(),
            [](const RankFlight& a, const RankFlight& b) { return a.rank < b.rank; });
  return dumps;
}

std::string find_flight_dir(const std::string& run_dir) {
  auto holds_dumps = [](const fs::path& dir) {
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.starts_with("rank_") && name.ends_with(".json")) return true;
    }
    return false;
  };
  if (holds_dumps(run_dir)) return run_dir;
  const fs::path flight = fs::path(run_dir) / "flight";
  std::error_code ec;
  std::vector<fs::path> jobs;
  for (const fs::directory_entry& e : fs::directory_iterator(flight, ec)) {
    if (e.is_directory() && holds_dumps(e.path())) jobs.push_back(e.path());
  }
  MESHTRAIN_CHECK_AS(ErrorKind::io, !jobs.empty(),
                     "debug hang: no flight records in {} (expected {}/<job>/rank_<R>.json)",
                     run_dir, flight.string());
  // Job names start with the UTC start time, so the newest sorts last.
  std::sort(jobs.begin(), jobs.end());
  return jobs.back().string();
}

namespace {

using Ranks = std::map<int, const RankFlight*>;
// Per member world rank, its index of the communicator in its dump.
using Local = std::map<int, int>;

Local local_indices(const Ranks& by_rank, const CommIdentity& comm) {
  Local local;
  for (const auto& [rank, f] : by_rank) {
    for (size_t i = 0; i < f->comms.size(); ++i) {
      if (f->comms[i].name == comm.name && f->comms[i].members == comm.members) {
        local[rank] = static_cast<int>(i);
      }
    }
  }
  return local;
}

// Who is where relative to call `seq` of the communicator.
CommHang examine(const Ranks& by_rank, const Local& local, const CommIdentity& comm, uint64_t seq) {
  CommHang h;
  h.comm = {comm.name, comm.members, 0};
  h.seq = seq;
  bool p2p = false;
  for (int m : comm.members) {
    auto it = local.find(m);
    if (it == local.end()) {
      h.missing.push_back(m);
      continue;
    }
    const RankFlight& f = *by_rank.at(m);
    if (f.late()) {
      h.late.push_back(m);
      continue;
    }
    const CommProgress& p = f.progress[static_cast<size_t>(it->second)];
    if (p.issued <= seq) {
      h.behind.push_back({m, p.issued});
      continue;
    }
    if (p.first_unfinished > seq) {
      h.ahead.push_back(m);
      h.ahead_at.push_back(p.first_unfinished);
      continue;
    }
    const DumpedCall* call = nullptr;
    for (const DumpedCall& c : f.calls) {
      if (c.comm == it->second && c.seq == seq) call = &c;
    }
    // Issued but still queued behind another call: not in MPI's call yet.
    if (call != nullptr && call->state == CallState::queued) {
      h.behind.push_back({m, p.issued, true});
      continue;
    }
    h.in_call.push_back(m);
    if (call != nullptr) {
      h.op = call->op;
      h.dtype = call->dtype;
      h.bytes = call->bytes;
      h.waited_s = std::max(h.waited_s, call->started_ago_s);
      p2p = is_p2p(call->op);
    }
  }
  // Point-to-point sequence numbers do not pair up across ranks: only a
  // missing peer is evidence there.
  if (p2p) {
    for (const BehindRank& b : h.behind) {
      h.ahead.push_back(b.rank);
      h.ahead_at.push_back(b.issued);
    }
    h.behind.clear();
  }
  return h;
}

Ranks index_by_rank(const std::vector<RankFlight>& dumps) {
  Ranks by_rank;
  for (const RankFlight& f : dumps) by_rank[f.rank] = &f;
  return by_rank;
}

}  // namespace

CommHang hang_at(const std::vector<RankFlight>& dumps, const CommIdentity& comm, uint64_t seq) {
  const Ranks by_rank = index_by_rank(dumps);
  return examine(by_rank, local_indices(by_rank, comm), comm, seq);
}

HangDiagnosis diagnose_hang(const std::vector<RankFlight>& dumps) {
  HangDiagnosis d;
  const Ranks by_rank = index_by_rank(dumps);
  for (const RankFlight& f : dumps) {
    d.world_size = std::max(d.world_size, f.world_size);
    if (f.reason == "timeout") d.timed_out.push_back(f.rank);
    if (f.late()) d.late.push_back(f.rank);
  }
  for (int r = 0; r < d.world_size; ++r) {
    (by_rank.count(r) ? d.dumped : d.missing).push_back(r);
  }
  std::set<std::pair<std::string, std::vector<int>>> comms;
  for (const RankFlight& f : dumps) {
    for (const CommIdentity& c : f.comms) comms.insert({c.name, c.members});
  }
  for (const auto& [name, members] : comms) {
    const CommIdentity comm{name, members, 0};
    const Local local = local_indices(by_rank, comm);
    // The first call some member has issued and not finished.
    bool pending = false;
    uint64_t seq = 0;
    for (const auto& [rank, index] : local) {
      const CommProgress& p = by_rank.at(rank)->progress[static_cast<size_t>(index)];
      if (p.first_unfinished < p.issued) {
        seq = pending ? std::min(seq, p.first_unfinished) : p.first_unfinished;
        pending = true;
      }
    }
    if (pending) d.hangs.push_back(examine(by_rank, local, comm, seq));
  }
  std::stable_sort(d.hangs.begin(), d.hangs.end(),
                   [](const CommHang& a, const CommHang& b) { return a.waited_s > b.waited_s; });
  if (!d.missing.empty() || !d.late.empty()) {
    d.suspects = d.missing;
    d.suspects.insert(d.suspects.end(), d.late.begin(), d.late.end());
    std::sort(d.suspects.begin(), d.suspects.end());
  } else if (!d.hangs.empty()) {
    // Everyone reported: the ranks behind in the oldest hang (none: every
    // member is in the call and its data does not arrive: a broken link).
    for (const BehindRank& b : d.hangs.front().behind) d.suspects.push_back(b.rank);
  }
  return d;
}

std::string describe_not_arrived(const CommHang& h) {
  std::vector<std::string> parts;
  for (int m : h.missing) {
    parts.push_back(fmt::format("{} (no flight record: stopped, dead or unreachable)", m));
  }
  for (int m : h.late) {
    parts.push_back(fmt::format("{} (stalled: its flight record came only as the job ended)", m));
  }
  for (const BehindRank& b : h.behind) {
    if (b.queued) {
      parts.push_back(
          fmt::format("{} (behind: its seq {} is queued after another call)", b.rank, h.seq));
      continue;
    }
    parts.push_back(b.issued == 0 ? fmt::format("{} (behind: no call yet)", b.rank)
                                  : fmt::format("{} (behind: at seq {})", b.rank, b.issued - 1));
  }
  if (parts.empty()) {
    return "none (every member is in the call: the data does not arrive; a link down?)";
  }
  std::string s;
  for (const std::string& p : parts) s += (s.empty() ? "" : ", ") + p;
  return s;
}

std::string format_hang_report(const HangDiagnosis& d, const std::string& dir) {
  std::string out = fmt::format("flight records: {} ({} of {} ranks; missing: {}; late: {})\n",
                                dir, d.dumped.size(), d.world_size, join(d.missing), join(d.late));
  out += fmt::format("deadline passed on ranks: {}\n", join(d.timed_out));
  if (d.hangs.empty()) out += "no communicator has a pending call: the ranks agree\n";
  for (const CommHang& h : d.hangs) {
    std::string ahead;
    for (size_t i = 0; i < h.ahead.size(); ++i) {
      ahead += fmt::format("{}{} (at seq {})", i ? ", " : "", h.ahead[i], h.ahead_at[i]);
    }
    out += fmt::format(
        "comm {} [{}]: ranks disagree at seq {} ({} {}, {}), waiting {:.1f} s: in it: {}; ahead: "
        "{}; not arrived: {}\n",
        h.comm.name, join(h.comm.members), h.seq, h.op.empty() ? "?" : h.op,
        h.dtype.empty() ? "?" : h.dtype, format_bytes(h.bytes), h.waited_s, join(h.in_call),
        ahead.empty() ? "none" : ahead, describe_not_arrived(h));
  }
  if (!d.hangs.empty()) {
    const CommHang& h = d.hangs.front();
    out += fmt::format("diagnosis: stuck in comm {} {} seq {}; waiting for rank(s) {}\n",
                       h.comm.name, h.op.empty() ? "?" : h.op, h.seq,
                       d.suspects.empty() ? "none (a link down?)" : join(d.suspects));
  }
  return out;
}

}  // namespace meshtrain
