#include "meshtrain/plan/search.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <tuple>

#include "meshtrain/util/error.h"

namespace meshtrain::plan {

RankBy parse_rank_by(std::string_view name) {
  if (name == "time") return RankBy::time;
  if (name == "cost") return RankBy::cost;
  fail("plan: unknown --rank-by '{}' (expected time or cost)", name);
}

std::string family_name(const Layout& l) {
  std::string name;
  if (l.tp > 1) name += "TP + ";
  if (l.cp > 1) name += "CP + ";
  if (l.ep > 1) name += "EP + ";
  if (l.pp > 1) name += "PP + ";
  name += l.zero < 3     ? "DP (ZeRO-0/1/2)"
          : l.shard > 0 ? "HSDP (ZeRO-3 in groups)"
                        : "FSDP (ZeRO-3)";
  if (l.offload != Offload::none) name += " + offload";
  return name;
}

bool ranks_before(const Estimate& a, const Estimate& b, RankBy by) {
  const double x = by == RankBy::cost ? a.cost : a.step_seconds;
  const double y = by == RankBy::cost ? b.cost : b.step_seconds;
  if (std::fabs(x - y) > 1e-9 * std::max(x, y)) return x < y;
  return a.memory.device_total() < b.memory.device_total();  // a tie: the one with more headroom
}

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d * d <= n; ++d) {
    if (n % d == 0) {
      out.push_back(d);
      if (d != n / d) out.push_back(n / d);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

template <typename T>
std::vector<T> choices(const std::optional<T>& fixed, std::vector<T> all) {
  if (fixed) return {*fixed};
  return all;
}

// Fixed choices the model or cluster can never satisfy: one clear line.
void check_fixed(const PlanContext& ctx, const Cluster& cl, const FixedChoices& f) {
  const ModelConfig& m = ctx.model;
  if (f.tp) {
    MESHTRAIN_CHECK(*f.tp >= 1, "plan: --tp must be >= 1, got {}", *f.tp);
    MESHTRAIN_CHECK(m.n_heads % *f.tp == 0, "plan: --tp {} does not divide the {} attention heads",
                    *f.tp, m.n_heads);
    MESHTRAIN_CHECK(m.n_kv_heads % *f.tp == 0, "plan: --tp {} does not divide the {} kv heads",
                    *f.tp, m.n_kv_heads);
    MESHTRAIN_CHECK(m.hidden_dim % *f.tp == 0, "plan: --tp {} does not divide the MLP width {}",
                    *f.tp, m.hidden_dim);
    MESHTRAIN_CHECK(cl.gpus % *f.tp == 0, "plan: --tp {} does not divide --gpus {}", *f.tp,
                    cl.gpus);
  }
  if (f.pp) {
    MESHTRAIN_CHECK(*f.pp >= 1 && *f.pp <= m.n_layers,
                    "plan: --pp {} must be in 1..{} (the model's layers)", *f.pp, m.n_layers);
    MESHTRAIN_CHECK(cl.gpus % *f.pp == 0, "plan: --pp {} does not divide --gpus {}", *f.pp,
                    cl.gpus);
  }
  if (f.vpp) MESHTRAIN_CHECK(*f.vpp >= 1, "plan: --vpp must be >= 1, got {}", *f.vpp);
  if (f.dp) {
    MESHTRAIN_CHECK(*f.dp >= 1 && cl.gpus % *f.dp == 0, "plan: --dp {} does not divide --gpus {}",
                    *f.dp, cl.gpus);
  }
  if (f.tp && f.pp && f.dp) {
    const int64_t cp = f.cp ? *f.cp : 1;
    MESHTRAIN_CHECK(*f.tp * cp * *f.pp * *f.dp == cl.gpus,
                    "plan: --tp {}{} x --pp {} x --dp {} = {} is not --gpus {}", *f.tp,
                    cp > 1 ? fmt::format(" x --cp {}", cp) : "", *f.pp, *f.dp,
                    *f.tp * cp * *f.pp * *f.dp, cl.gpus);
  }
  if (f.zero) {
    MESHTRAIN_CHECK(*f.zero >= 0 && *f.zero <= 3, "plan: --zero must be 0..3, got {}", *f.zero);
  }
  if (f.cp) {
    MESHTRAIN_CHECK(*f.cp >= 1 && cl.gpus % *f.cp == 0, "plan: --cp {} does not divide --gpus {}",
                    *f.cp, cl.gpus);
  }
  if (f.ep) {
    MESHTRAIN_CHECK(*f.ep >= 1 && (*f.ep == 1 || m.moe.enabled()),
                    "plan: --ep {} needs a mixture-of-experts model with ep >= 1", *f.ep);
    MESHTRAIN_CHECK(*f.ep == 1 || m.moe.experts % *f.ep == 0,
                    "plan: --ep {} does not divide the {} experts", *f.ep, m.moe.experts);
  }
  if (f.ep_fold) {
    MESHTRAIN_CHECK(m.moe.enabled(), "plan: --ep-fold needs a mixture-of-experts model");
  }
  if (f.shard) {
    MESHTRAIN_CHECK(*f.shard >= 0, "plan: --shard must be >= 2 or 'dp', got {}", *f.shard);
    MESHTRAIN_CHECK(!f.zero || *f.zero == 3, "plan: --shard (hybrid sharding) needs --zero 3");
  }
  if (f.micro_batch) {
    MESHTRAIN_CHECK(*f.micro_batch >= 1, "plan: --micro-batch must be >= 1, got {}",
                    *f.micro_batch);
  }
  if (f.sequence_parallel && *f.sequence_parallel && f.tp) {
    MESHTRAIN_CHECK(*f.tp > 1, "plan: --sp on needs --tp > 1");
  }
}

}  // namespace

SearchResult search(const PlanContext& ctx, const Cluster& base, const Job& job,
                    const SearchOptions& opt) {
  const auto start = std::chrono::steady_clock::now();
  MESHTRAIN_CHECK(!opt.gpu_counts.empty(), "plan: --gpus is required");
  MESHTRAIN_CHECK(opt.top >= 1, "plan: --top must be >= 1, got {}", opt.top);
  MESHTRAIN_CHECK(opt.max_train_seconds >= 0, "plan: --max-days must be >= 0");
  job.validate();
  const FixedChoices& f = opt.fixed;
  const ModelConfig& model = ctx.model;

  SearchResult result;
  std::vector<Estimate> fitting;
  std::map<std::string, FamilyReport> families;
  std::map<std::string, std::map<std::string, int64_t>> reasons;  // family -> reason -> count

  auto consider = [&](const Cluster& cl, const Layout& l) {
    ++result.evaluated;
    const std::string family = family_name(l);
    FamilyReport& fam = families[family];
    fam.family = family;
    const std::string why = check_layout(ctx, cl, job, l);
    if (!why.empty()) {
      ++reasons[family][why];
      return;
    }
    ++result.valid;
    ++fam.valid;
    Estimate est = evaluate(ctx, cl, job, l);
    if (!fam.smallest || est.memory.device_total() < fam.smallest->memory.device_total()) {
      fam.smallest = est;
    }
    if (!est.fits) return;
    ++result.fits;
    ++fam.fits;
    if (opt.max_train_seconds > 0 && est.train_seconds > opt.max_train_seconds) {
      ++result.too_slow;
      ++fam.too_slow;
      if (!fam.fastest_too_slow || est.train_seconds < fam.fastest_too_slow->train_seconds) {
        fam.fastest_too_slow = est;
      }
      return;
    }
    if (!fam.best || ranks_before(est, *fam.best, opt.rank_by)) fam.best = est;
    fitting.push_back(std::move(est));
  };

  // Every (pp, v, ZeRO, micro-batch, recomputation, offload) for one tp x cp.
  auto enumerate_pp = [&](const Cluster& cl, int64_t gpus, int64_t tp, int64_t cp,
                          const std::vector<Offload>& offloads) {
    for (int64_t pp : choices(f.pp, divisors(gpus / (tp * cp)))) {
      if (gpus % (tp * cp * pp) != 0 || pp > model.n_layers) continue;
      const int64_t dp = gpus / (tp * cp * pp);
      if (f.dp && *f.dp != dp) continue;
      const std::vector<int64_t> vpps =
          pp > 1 ? std::vector<int64_t>{1, 2, 3, 4, 5, 6, 8} : std::vector<int64_t>{1};
      // (ZeRO stage, shard group): without data parallelism there is nothing to
      // shard; ZeRO-3 over the whole DP group, or hybrid: sharded in groups of a
      // node's worth of DP ranks (and 2x, 4x, ...) and replicated across them.
      std::vector<std::pair<int, int64_t>> shardings;
      for (int zero : choices(f.zero, dp > 1 ? std::vector<int>{0, 1, 2, 3}
                                             : std::vector<int>{0})) {
        if (f.shard) {  // fixed: check_layout says when it cannot be
          // --shard equal to dp is full sharding.
          if (zero == 3) shardings.emplace_back(zero, *f.shard == dp ? 0 : *f.shard);
          continue;
        }
        shardings.emplace_back(zero, 0);
        if (zero != 3 || f.zero) continue;  // --zero 3 alone means full sharding
        for (int64_t g = std::max<int64_t>(2, cl.gpus_per_node / tp); g < dp; g *= 2) {
          if (dp % g == 0) shardings.emplace_back(zero, g);
        }
      }
      // Expert parallelism: every ep that divides dp (folded: tp x cp x dp)
      // and the experts (MoE only).
      std::vector<int64_t> eps{1};
      if (model.moe.enabled()) {
        eps.clear();
        for (int64_t e : divisors(f.ep_fold ? tp * cp * dp : dp)) {
          if (model.moe.experts % e == 0) eps.push_back(e);
        }
      }
      for (int64_t ep : choices(f.ep, eps)) {
        for (int64_t vpp : choices(f.vpp, vpps)) {
          for (auto [zero, shard] : shardings) {
            for (int64_t mb : choices(f.micro_batch, {1, 2, 4, 8, 16})) {
              for (Recompute rc : choices(f.recompute, {Recompute::none, Recompute::selective,
                                                        Recompute::full})) {
                for (Offload off : offloads) {
                  Layout l;
                  l.tp = tp;
                  l.cp = cp;
                  l.ep = ep;
                  l.ep_fold = f.ep_fold && ep > 1;
                  l.pp = pp;
                  l.vpp = vpp;
                  l.dp = dp;
                  l.zero = zero;
                  l.shard = shard;
                  l.micro_batch = mb;
                  l.recompute = rc;
                  l.sequence_parallel = f.sequence_parallel ? *f.sequence_parallel : tp > 1;
                  l.offload = off;
                  l.schedule = vpp > 1 ? Schedule::interleaved : Schedule::one_f_one_b;
                  if (f.schedule) l.schedule = *f.schedule;
                  consider(cl, l);
                }
              }
            }
          }
        }
      }
    }
  };
  auto enumerate = [&](const std::vector<Offload>& offloads) {
    for (int64_t gpus : opt.gpu_counts) {
      Cluster cl = base;
      cl.gpus = gpus;
      validate(cl);
      MESHTRAIN_CHECK(!job.fp8 || cl.gpu.fp8_peak_flops > 0,
                      "plan: --fp8: the {} has no FP8 tensor cores", cl.gpu.name);
      check_fixed(ctx, cl, f);
      std::vector<int64_t> tps;
      for (int64_t t : divisors(gpus)) {
        if (t <= cl.gpus_per_node) tps.push_back(t);  // TP stays inside a node unless fixed
      }
      for (int64_t tp : choices(f.tp, tps)) {
        // Context parallelism only for long sequences (>= 16K), unless fixed;
        // never with a sliding window, which meshtrain's cp attention lacks.
        std::vector<int64_t> cps{1};
        if (job.seq >= 16384 && model.sliding_window == 0) {
          for (int64_t c = 2; c <= 32 && (gpus / tp) % c == 0; c *= 2) cps.push_back(c);
        }
        for (int64_t cp : choices(f.cp, cps)) {
          if ((gpus / tp) % cp != 0) continue;
          enumerate_pp(cl, gpus, tp, cp, offloads);
        }
      }
    }
  };
  // Offloading the optimizer state costs PCIe time: searched only when asked
  // for, or when nothing fits without it.
  enumerate(f.offload ? std::vector<Offload>{*f.offload} : std::vector<Offload>{Offload::none});
  if (result.fits == 0 && !f.offload) {
    result.offload_retried = true;
    enumerate({Offload::optimizer});
  }

  for (auto& [name, fam] : families) {
    if (fam.valid == 0) {
      const auto& counts = reasons[name];
      auto it = std::max_element(counts.begin(), counts.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
      if (it != counts.end()) fam.reason = it->first;
    }
    result.families.push_back(fam);
  }
  if (result.valid == 0) {
    std::string why = "no layout divides the model and batch";
    for (const FamilyReport& fam : result.families) {
      if (!fam.reason.empty()) {
        why = fam.reason;
        break;
      }
    }
    fail("plan: no layout can run: {}", why);
  }

  std::sort(fitting.begin(), fitting.end(),
            [&](const Estimate& a, const Estimate& b) { return ranks_before(a, b, opt.rank_by); });
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int>, bool> seen;
  for (Estimate& est : fitting) {
    const Layout& l = est.layout;
    auto key = std::make_tuple(est.gpus, l.tp, l.cp, l.ep, l.pp, l.vpp, l.zero);
    if (seen[key]) continue;
    seen[key] = true;
    result.ranked.push_back(std::move(est));
    if (static_cast<int>(result.ranked.size()) == opt.top) break;
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace meshtrain::plan
