#include "meshtrain/train/memory_report.h"

#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "meshtrain/train/distributed.h"
#include "meshtrain/train/metrics.h"

namespace meshtrain {

void report_memory(const char* when, int64_t step, const MemoryTracker& tracker,
                   const std::vector<RankMemory>& predicted, DeviceMesh* mesh,
                   MetricsLog& metrics, bool console) {
  const MemorySnapshot mine = tracker.snapshot();
  const bool ranks = mesh != nullptr && mesh->world().size() > 1;
  const int me = ranks ? mesh->world().rank() : 0;
  const RankMemory& want = predicted.at(static_cast<size_t>(me));
  nlohmann::json bytes, expected, basis;
  for (size_t c = 0; c < kMemCategories; ++c) {
    const std::string name(mem_category_name(static_cast<MemCategory>(c)));
    bytes[name] = mine.live[c];
    bytes[name + "_peak"] = mine.peak[c];
    expected[name] = static_cast<uint64_t>(want.peak[c]);
    basis[name] = std::string(prediction_basis_name(want.basis[c]));
  }
  bytes["total"] = mine.live_total;
  bytes["total_peak"] = mine.peak_total;
  expected["total"] = static_cast<uint64_t>(want.total());
  metrics.write({{"step", step},
                 {"memory", when},
                 {"rank", me},
                 {"bytes", bytes},
                 {"predicted", expected},
                 {"basis", basis}});

  // Every rank's peaks to every rank: one all-reduce of a slot per rank.
  const int world = ranks ? mesh->world().size() : 1;
  const size_t width = kMemCategories + 1;
  std::vector<int64_t> peaks(static_cast<size_t>(world) * width, 0);
  for (size_t c = 0; c < kMemCategories; ++c) {
    peaks[static_cast<size_t>(me) * width + c] = static_cast<int64_t>(mine.peak[c]);
  }
  peaks[static_cast<size_t>(me) * width + kMemCategories] = static_cast<int64_t>(mine.peak_total);
  if (ranks) {
    mesh->world().all_reduce(peaks.data(), static_cast<int64_t>(peaks.size()), CommDType::i64,
                             ReduceOp::sum);
  }
  const MemorySnapshot max = ranks ? max_over_ranks(mesh->world(), mine) : mine;
  if (!console) return;
  fmt::print("memory at {}: {}\n", when, mine.report());
  if (ranks) {
    fmt::print("memory at {}, max over {} ranks: {}\n", when, world, max.report());
  }
  // measured peak / predicted, per rank and category.
  std::string header = fmt::format("  {:<5}", "rank");
  for (size_t c = 0; c < kMemCategories; ++c) {
    header += fmt::format(" {:>23}", mem_category_name(static_cast<MemCategory>(c)));
  }
  fmt::print("memory at {}, peak measured / predicted per rank:\n{} {:>23}\n", when, header,
             "total");
  for (int r = 0; r < world; ++r) {
    const RankMemory& p = predicted.at(static_cast<size_t>(r));
    std::string line = fmt::format("  {:<5}", r);
    for (size_t c = 0; c <= kMemCategories; ++c) {
      const double expect = c < kMemCategories ? p.peak[c] : p.total();
      const auto got = static_cast<size_t>(peaks[static_cast<size_t>(r) * width + c]);
      line += fmt::format(" {:>23}", format_bytes(got) + " / " +
                                         format_bytes(static_cast<size_t>(expect)));
    }
    fmt::print("{}\n", line);
  }
  std::fflush(stdout);
}

}  // namespace meshtrain
