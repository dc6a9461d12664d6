#include "meshtrain/parallel/pipeline/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>

#include "meshtrain/util/error.h"

namespace meshtrain::pipeline {

ScheduleKind parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::gpipe;
  if (name == "1f1b") return ScheduleKind::one_f_one_b;
  if (name == "interleaved") return ScheduleKind::interleaved;
  fail("pipeline: unknown schedule '{}' (gpipe, 1f1b, interleaved)", name);
}

const char* schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved: return "interleaved";
  }
  return "?";
}

void check_shape(ScheduleKind kind, const PipelineShape& s) {
  MESHTRAIN_CHECK(s.stages >= 1 && s.micro_batches >= 1 && s.virtual_stages >= 1,
                  "pipeline: stages {}, micro-batches {} and virtual stages {} must be >= 1",
                  s.stages, s.micro_batches, s.virtual_stages);
  if (kind != ScheduleKind::interleaved) {
    MESHTRAIN_CHECK(s.virtual_stages == 1,
                    "pipeline: schedule {} runs one chunk per rank; virtual_stages = {} needs "
                    "schedule 'interleaved'",
                    schedule_kind_name(kind), s.virtual_stages);
    return;
  }
  MESHTRAIN_CHECK(s.stages >= 2, "pipeline: schedule interleaved needs pp >= 2, got {}",
                  s.stages);
  MESHTRAIN_CHECK(s.virtual_stages >= 2,
                  "pipeline: schedule interleaved needs virtual_stages >= 2, got {}",
                  s.virtual_stages);
  MESHTRAIN_CHECK(s.micro_batches % s.stages == 0,
                  "pipeline: schedule interleaved needs the micro-batches per step ({}) to be a "
                  "multiple of pp ({})",
                  s.micro_batches, s.stages);
}

namespace {

struct Compute {
  bool backward = false;
  int chunk = 0, micro_batch = 0;
};

// The order one rank runs its forwards and backwards.
std::vector<Compute> compute_order(ScheduleKind kind, const PipelineShape& s, int rank) {
  const int p = s.stages, m = s.micro_batches, v = s.virtual_stages;
  std::vector<Compute> order;
  if (kind == ScheduleKind::gpipe) {
    for (int i = 0; i < m; ++i) order.push_back({false, 0, i});
    for (int i = 0; i < m; ++i) order.push_back({true, 0, i});
    return order;
  }
  // 1F1B (v = 1) and interleaved 1F1B: the k-th forward / backward of a rank.
  auto nth = [&](int k, bool backward) {
    const int in_group = k % (p * v);
    int chunk = in_group / p;
    if (backward) chunk = v - 1 - chunk;
    return Compute{backward, chunk, (k / (p * v)) * p + k % p};
  };
  const int total = m * v;
  const int warmup =
      std::min(total, v == 1 ? p - rank - 1 : (p - rank - 1) * 2 + (v - 1) * p);
  for (int k = 0; k < warmup; ++k) order.push_back(nth(k, false));
  for (int i = 0; i < total - warmup; ++i) {
    order.push_back(nth(warmup + i, false));
    order.push_back(nth(i, true));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(nth(k, true));
  return order;
}

int message_tag(const PipelineShape& s, int virtual_stage, int micro_batch, bool grad) {
  return (micro_batch * s.total_stages() + virtual_stage) * 2 + (grad ? 1 : 0);
}

}  // namespace

Schedule make_schedule(ScheduleKind kind, const PipelineShape& s) {
  check_shape(kind, s);
  const int p = s.stages, last = s.total_stages() - 1;
  Schedule schedule(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    RankSchedule& list = schedule[static_cast<size_t>(r)];
    const std::vector<Compute> order = compute_order(kind, s, r);
    // The receive compute k needs, if any.
    auto receive_of = [&](const Compute& c) -> std::optional<Transfer> {
      const int vs = c.chunk * p + r;
      if (!c.backward && vs > 0) {
        return Transfer{false, false, c.chunk, c.micro_batch, (vs - 1) % p,
                        message_tag(s, vs, c.micro_batch, false)};
      }
      if (c.backward && vs < last) {
        return Transfer{false, true, c.chunk, c.micro_batch, (vs + 1) % p,
                        message_tag(s, vs, c.micro_batch, true)};
      }
      return std::nullopt;
    };
    auto post_receive = [&](size_t k) {
      if (k >= order.size()) return -1;
      const std::optional<Transfer> t = receive_of(order[k]);
      if (!t) return -1;
      list.push_back(Action{ActionKind::send_recv, 0, 0, -1, {*t}});
      return static_cast<int>(list.size()) - 1;
    };
    int next_receive = post_receive(0);
    for (size_t k = 0; k < order.size(); ++k) {
      const Compute& c = order[k];
      const int receive = next_receive;
      next_receive = post_receive(k + 1);  // one compute ahead
      list.push_back(Action{c.backward ? ActionKind::backward : ActionKind::forward, c.chunk,
                            c.micro_batch, receive, {}});
      const int vs = c.chunk * p + r;
      if (!c.backward && vs < last) {
        list.push_back(Action{ActionKind::send_recv, 0, 0, -1,
                              {Transfer{true, false, c.chunk, c.micro_batch, (vs + 1) % p,
                                        message_tag(s, vs + 1, c.micro_batch, false)}}});
      }
      if (c.backward && vs > 0) {
        list.push_back(Action{ActionKind::send_recv, 0, 0, -1,
                              {Transfer{true, true, c.chunk, c.micro_batch, (vs - 1 + p) % p,
                                        message_tag(s, vs - 1, c.micro_batch, true)}}});
      }
    }
  }
  return schedule;
}

namespace {

std::string describe(const Action& a) {
  if (a.kind == ActionKind::send_recv) {
    std::string s;
    for (const Transfer& t : a.transfers) {
      s += fmt::format("{}{} {} c{} mb{} rank {}", s.empty() ? "" : ", ", t.send ? "send" : "recv",
                       t.grad ? "grad" : "act", t.chunk, t.micro_batch, t.peer);
    }
    return "[" + s + "]";
  }
  return fmt::format("{}(c{} mb{})", a.kind == ActionKind::forward ? "F" : "B", a.chunk,
                     a.micro_batch);
}

}  // namespace

SimResult simulate(const Schedule& schedule, const PipelineShape& shape, int forward_ticks,
                   int backward_ticks) {
  (void)shape;
  const size_t p = schedule.size();
  SimResult result;
  result.compute.resize(p);
  std::vector<size_t> pc(p, 0);
  std::vector<int> clock(p, 0);
  // Posting times of each message's two sides, by (tag, sender, receiver).
  std::map<std::tuple<int, int, int>, std::pair<int, int>> posted;
  auto side = [&](size_t r, const Transfer& t) -> int& {
    const int me = static_cast<int>(r);
    auto key = t.send ? std::tuple{t.tag, me, t.peer} : std::tuple{t.tag, t.peer, me};
    auto [it, inserted] = posted.try_emplace(key, std::pair{-1, -1});
    return t.send ? it->second.first : it->second.second;
  };
  // When a send_recv action completed: -1 = not yet.
  auto completion = [&](size_t r, const Action& a) {
    int when = 0;
    for (const Transfer& t : a.transfers) {
      const int mine = side(r, t);
      const int me = static_cast<int>(r);
      auto key = t.send ? std::tuple{t.tag, me, t.peer} : std::tuple{t.tag, t.peer, me};
      const auto& both = posted[key];
      const int theirs = t.send ? both.second : both.first;
      if (mine < 0 || theirs < 0) return -1;
      when = std::max({when, mine, theirs});
    }
    return when;
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (size_t r = 0; r < p; ++r) {
      const RankSchedule& list = schedule[r];
      while (pc[r] < list.size()) {
        const Action& a = list[pc[r]];
        if (a.kind == ActionKind::send_recv) {
          for (const Transfer& t : a.transfers) side(r, t) = clock[r];
        } else {
          int ready = clock[r];
          if (a.receive >= 0) {
            const int done = completion(r, list[static_cast<size_t>(a.receive)]);
            if (done < 0) break;
            ready = std::max(ready, done);
          }
          const int ticks = a.kind == ActionKind::forward ? forward_ticks : backward_ticks;
          result.compute[r].push_back({ready, ready + ticks, a});
          clock[r] = ready + ticks;
        }
        ++pc[r];
        progress = true;
      }
    }
  }
  for (size_t r = 0; r < p; ++r) {
    result.makespan = std::max(result.makespan, clock[r]);
    if (pc[r] < schedule[r].size()) {
      result.deadlock = true;
      result.message += fmt::format("rank {} stuck at action {} of {} ({}); ", r, pc[r],
                                    schedule[r].size(), describe(schedule[r][pc[r]]));
    }
  }
  // Every send must have been received (and every receive sent).
  for (const auto& [key, both] : posted) {
    if (both.first < 0 || both.second < 0) {
      result.deadlock = true;
      result.message += fmt::format("message tag {} from rank {} to rank {} never {}; ",
                                    std::get<0>(key), std::get<1>(key), std::get<2>(key),
                                    both.first < 0 ? "sent" : "received");
    }
  }
  return result;
}

double SimResult::bubble() const {
  double sum = 0;
  for (const auto& slots : compute) {
    int busy = 0;
    for (const Slot& s : slots) busy += s.end - s.start;
    sum += busy > 0 ? static_cast<double>(makespan - busy) / busy : 0.0;
  }
  return compute.empty() ? 0.0 : sum / static_cast<double>(compute.size());
}

std::string format_timeline(const SimResult& result, const PipelineShape& shape) {
  std::string out;
  for (size_t r = 0; r < result.compute.size(); ++r) {
    std::vector<std::string> cells(static_cast<size_t>(result.makespan), ".");
    for (const SimResult::Slot& s : result.compute[r]) {
      std::string cell = fmt::format("{}{}", s.action.kind == ActionKind::forward ? "F" : "B",
                                     s.action.micro_batch);
      if (shape.virtual_stages > 1) cell += static_cast<char>('a' + s.action.chunk);
      for (int t = s.start; t < s.end; ++t) cells[static_cast<size_t>(t)] = cell;
    }
    out += fmt::format("rank {:>2} |", r);
    for (const std::string& c : cells) out += fmt::format(" {:<4}", c);
    out += "\n";
  }
  return out;
}

double theoretical_bubble(const PipelineShape& s) {
  return static_cast<double>(s.stages - 1) /
         static_cast<double>(s.virtual_stages * s.micro_batches);
}

}  // namespace meshtrain::pipeline
