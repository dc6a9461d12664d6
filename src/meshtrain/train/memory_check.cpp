#include "meshtrain/train/memory_check.h"

#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "meshtrain/train/distributed.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

std::string bytes_text(double bytes) { return format_bytes(static_cast<size_t>(std::max(0.0, bytes))); }

std::optional<double> read_number(const fs::path& path) {
  std::ifstream in(path);
  std::string text;
  if (!in || !(in >> text) || text == "max") return std::nullopt;
  try {
    return std::stod(text);
  } catch (...) {
    return std::nullopt;
  }
}

// The tightest limit from `dir` up to `top` (cgroups nest: every ancestor's applies).
void cgroup_limit(const fs::path& top, const std::string& rel, const char* limit_file,
                  const char* usage_file, const char* version, std::vector<MemoryLimit>& out) {
  std::optional<MemoryLimit> best;
  fs::path dir = top / fs::path(rel).relative_path();
  for (;;) {
    const std::optional<double> limit = read_number(dir / limit_file);
    // v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages).
    if (limit && *limit < 1e18) {
      const double used = read_number(dir / usage_file).value_or(0);
      MemoryLimit l{*limit - used,
                    fmt::format("cgroup {} {} (limit {}, in use {})", version,
                                (dir / limit_file).string(), bytes_text(*limit), bytes_text(used))};
      if (!best || l.available < best->available) best = l;
    }
    if (dir == top || !dir.has_parent_path() || dir.parent_path() == dir) break;
    dir = dir.parent_path();
    if (dir.string().size() < top.string().size()) break;
  }
  if (best) out.push_back(*best);
}

}  // namespace

std::vector<MemoryLimit> host_memory_limits(const std::string& root) {
  std::vector<MemoryLimit> out;
  const fs::path base = root.empty() ? fs::path("/") : fs::path(root);
  std::ifstream cgroups(base / "proc/self/cgroup");
  std::string line;
  while (std::getline(cgroups, line)) {
    // "hierarchy-id:controllers:path"
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {  // v2 (unified); mounted at /sys/fs/cgroup or .../unified
      for (const char* mount : {"sys/fs/cgroup/unified", "sys/fs/cgroup"}) {
        if (fs::exists(base / mount / "cgroup.controllers")) {
          cgroup_limit(base / mount, path, "memory.max", "memory.current", "v2", out);
          break;
        }
      }
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      cgroup_limit(base / "sys/fs/cgroup/memory", path, "memory.limit_in_bytes",
                   "memory.usage_in_bytes", "v1", out);
    }
  }
  std::ifstream meminfo(base / "proc/meminfo");
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      double kib = 0;
      if (fields >> kib) {
        out.push_back({kib * 1024, fmt::format("MemAvailable in {}", (base / "proc/meminfo").string())});
      }
    }
  }
  return out;
}

std::optional<std::string> offload_budget_refusal(const RankMemory& r) {
  if (r.offload_tier == "none" || r.offload_budget <= 0 || r.offload_budget >= 2 * r.offload_piece) {
    return std::nullopt;
  }
  return fmt::format(
      "rank {}: parallel.offload_budget_mb = {} ({}) holds less than two offload pieces of {} "
      "(one in use, the next read ahead): set parallel.offload_budget_mb >= {:.2f}, or 0 for no "
      "limit",
      r.rank, r.offload_budget / (1024.0 * 1024.0), bytes_text(r.offload_budget),
      bytes_text(r.offload_piece), std::ceil(2 * r.offload_piece / (1024.0 * 1024.0) * 100) / 100);
}

namespace {

std::string by_category(const RankMemory& r) {
  std::string text;
  for (size_t c = 0; c < kMemCategories; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    if (cat == MemCategory::offloaded || r.peak[c] <= 0) continue;
    text += fmt::format("{}{} {}", text.empty() ? "" : ", ", mem_category_name(cat),
                        bytes_text(r.peak[c]));
  }
  if (r.offload_tier == "cpu") {
    text += fmt::format(", cpu offload host copies {}", bytes_text(r.at(MemCategory::offloaded)));
  }
  return text;
}

double host_need(const std::vector<RankMemory>& ranks, const std::vector<int>& host) {
  double sum = 0;
  for (int r : host) sum += ranks[static_cast<size_t>(r)].host_bytes;
  return sum;
}

// The levers, each as the config change and what the host would then need.
std::string levers(const TrainConfig& config, const std::vector<RankMemory>& ranks,
                   const std::vector<int>& host, double available) {
  const int world = static_cast<int>(ranks.size());
  std::vector<std::string> out;
  auto try_change = [&](const std::string& what, const std::function<void(TrainConfig&)>& edit) {
    TrainConfig changed = config;
    edit(changed);
    try {
      const double need = host_need(predict_run_memory(changed, world), host);
      out.push_back(fmt::format("{} would need {}{}", what, bytes_text(need),
                                need <= available ? " (fits)" : ""));
    } catch (const Error&) {  // a layout the engine refuses is no lever
    }
  };
  const ParallelSettings& p = config.parallel;
  const int dp = world / (p.tp * p.pp * p.cp);
  if (dp > 1 && p.zero < 3) {
    try_change("parallel.zero = 3", [](TrainConfig& c) { c.parallel.zero = 3; });
  }
  if (config.train.recompute != Recompute::full || config.train.recompute_layers > 0) {
    try_change("train.recompute = \"full\"", [](TrainConfig& c) {
      c.train.recompute = Recompute::full;
      c.train.recompute_layers = 0;
    });
  }
  if (config.train.micro_batch_size > 1) {
    try_change("train.micro_batch_size = 1", [](TrainConfig& c) { c.train.micro_batch_size = 1; });
  }
  // Context parallelism on more ranks, when activations are most of a rank:
  // the sequence cut over 2 or 4 times the ranks.
  const auto big = std::max_element(ranks.begin(), ranks.end(), [](const auto& a, const auto& b) {
    return a.host_bytes < b.host_bytes;
  });
  const double activations = big->peak[static_cast<size_t>(MemCategory::activations)];
  for (int more : {2, 4}) {
    const int cp = p.cp * more;
    if (2 * activations < big->total() || config.train.seq_len % (2 * cp) != 0) continue;
    TrainConfig changed = config;
    changed.parallel.cp = cp;
    try {
      const std::vector<RankMemory> wider = predict_run_memory(changed, world * more);
      double most = 0;
      for (const RankMemory& r : wider) most = std::max(most, r.host_bytes);
      const double need = most * static_cast<double>(host.size());
      out.push_back(fmt::format("parallel.cp = {} on {} ranks would need {} per rank ({} for {} on "
                                "this host){}",
                                cp, world * more, bytes_text(most), bytes_text(need), host.size(),
                                need <= available ? " (fits)" : ""));
    } catch (const Error&) {
    }
  }
  if (p.offload != "disk") {
    try_change(p.zero == 0 ? "parallel.zero = 1 with parallel.offload = \"disk\" (budget 64 MiB)"
                           : "parallel.offload = \"disk\" (budget 64 MiB)",
               [](TrainConfig& c) {
                 c.parallel.zero = std::max(c.parallel.zero, 1);
                 c.parallel.offload = "disk";
                 c.parallel.offload_budget_mb = 64;
               });
  }
  return out.empty() ? "no lever in this config would make it fit" : fmt::format("{}", fmt::join(out, "; "));
}

}  // namespace

std::optional<std::string> memory_refusal(const TrainConfig& config,
                                          const std::vector<RankMemory>& ranks,
                                          const std::vector<int>& host_ranks,
                                          const std::vector<MemoryLimit>& limits) {
  const double need = host_need(ranks, host_ranks);
  std::vector<std::string> causes;
  for (const MemoryLimit& limit : limits) {
    if (need <= limit.available) continue;
    // The host's largest rank names the numbers.
    const RankMemory* big = &ranks[static_cast<size_t>(host_ranks.front())];
    for (int r : host_ranks) {
      if (ranks[static_cast<size_t>(r)].host_bytes > big->host_bytes) big = &ranks[static_cast<size_t>(r)];
    }
    std::string who = host_ranks.size() == 1
                          ? fmt::format("rank {} needs {} ({})", big->rank, bytes_text(need),
                                        by_category(*big))
                          : fmt::format("the {} ranks on this host ({}) need {} (rank {}: {})",
                                        host_ranks.size(), fmt::join(host_ranks, ","),
                                        bytes_text(need), big->rank, by_category(*big));
    causes.push_back(fmt::format(
        "memory check: {}, more than the {} available by {}; levers: {} (train.memory_check = "
        "\"warn\" or \"off\" skips this check)",
        who, bytes_text(limit.available), limit.source,
        levers(config, ranks, host_ranks, limit.available)));
  }
  // The disk tier's file needs the offloaded bytes of every rank writing there.
  const RankMemory& first = ranks[static_cast<size_t>(host_ranks.front())];
  if (first.offload_tier == "disk" && !first.offload_dir.empty()) {
    double offloaded = 0;
    for (int r : host_ranks) offloaded += ranks[static_cast<size_t>(r)].at(MemCategory::offloaded);
    fs::path dir = first.offload_dir;
    while (!dir.empty() && !fs::exists(dir) && dir.has_parent_path() && dir.parent_path() != dir) {
      dir = dir.parent_path();
    }
    struct statvfs vfs{};
    if (!dir.empty() && statvfs(dir.c_str(), &vfs) == 0) {
      const double free_bytes = static_cast<double>(vfs.f_bavail) * static_cast<double>(vfs.f_frsize);
      if (offloaded > free_bytes) {
        causes.push_back(fmt::format(
            "memory check: parallel.offload = \"disk\" writes {} of optimizer state to '{}' "
            "(ranks {}), more than its {} free; set parallel.offload_dir to a larger disk",
            bytes_text(offloaded), first.offload_dir, fmt::join(host_ranks, ","),
            bytes_text(free_bytes)));
      }
    }
  }
  if (causes.empty()) return std::nullopt;
  return fmt::format("{}", fmt::join(causes, " | "));
}

namespace {

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace

void check_memory_before_allocating(const TrainConfig& config, const std::vector<RankMemory>& ranks,
                                    DeviceMesh* mesh, bool console) {
  Communicator* world = mesh != nullptr ? &mesh->world() : nullptr;
  const int me = world != nullptr ? world->rank() : 0;
  // The budget: every rank has the same numbers for every rank, no exchange needed.
  for (const RankMemory& r : ranks) {
    if (std::optional<std::string> why = offload_budget_refusal(r)) fail("config: {}", *why);
  }
  const std::string& mode = config.train.memory_check;
  if (mode == "off") return;
  // The ranks on this host: equal hostnames (an all-reduce of one slot each).
  std::vector<int> host{me};
  if (world != nullptr && world->size() > 1) {
    const auto key = static_cast<int64_t>(std::hash<std::string>{}(host_name()) >> 2);
    std::vector<int64_t> keys(static_cast<size_t>(world->size()), 0);
    keys[static_cast<size_t>(me)] = key;
    world->all_reduce(keys.data(), static_cast<int64_t>(keys.size()), CommDType::i64, ReduceOp::sum);
    host.clear();
    for (int r = 0; r < world->size(); ++r) {
      if (keys[static_cast<size_t>(r)] == key) host.push_back(r);
    }
  }
  std::optional<std::string> why = memory_refusal(config, ranks, host, host_memory_limits());
  // Collective: the lowest refusing rank's line goes to every rank.
  std::string line = why.value_or("");
  if (world != nullptr && world->size() > 1) {
    int64_t lowest = why ? world->size() - me : 0;
    world->all_reduce(&lowest, 1, CommDType::i64, ReduceOp::max);
    line = lowest == 0 ? "" : broadcast_string(*world, line, world->size() - static_cast<int>(lowest));
  }
  if (line.empty()) return;
  if (mode == "warn") {
    if (console) {
      fmt::print("warning: {}\n", line);
      std::fflush(stdout);
    }
    return;
  }
  fail("{}", line);
}

}  // namespace meshtrain
