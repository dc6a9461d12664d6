// The timeline tracer's cost per span (util/trace.h): off (the default: one
// relaxed atomic load) and on (two clock reads, the name, one append to the
// thread's buffer), and per communication call's pair of events. Per step:
// events per step x these (docs/benchmarks.md#timeline-trace).
#include <benchmark/benchmark.h>

#include "meshtrain/util/trace.h"

namespace meshtrain {
namespace {

void BM_SpanOff(benchmark::State& state) {
  trace::stop();
  int64_t layer = 0;
  for (auto _ : state) {
    trace::Span span("forward", "layer", layer++ & 7);
    benchmark::DoNotOptimize(span.active());
  }
}
BENCHMARK(BM_SpanOff);

// Bounded memory: every 100000 recorded events, drop them (untimed).
void drop_recorded_every(benchmark::State& state, int64_t& n) {
  if (++n < 100000) return;
  state.PauseTiming();
  trace::take();
  n = 0;
  state.ResumeTiming();
}

void BM_SpanOn(benchmark::State& state) {
  trace::start(trace::Clock::now());
  int64_t layer = 0, n = 0;
  for (auto _ : state) {
    {
      trace::Span span("forward", "layer", layer++ & 7);
      span.args(R"("micro_batch":{})", 1);
    }
    drop_recorded_every(state, n);
  }
  trace::stop();
  trace::take();
}
BENCHMARK(BM_SpanOn);

// A collective's issue instant + execution span, with its arguments.
void BM_CommCallOn(benchmark::State& state) {
  trace::start(trace::Clock::now());
  int64_t n = 0;
  for (auto _ : state) {
    const auto begin = trace::Clock::now();
    trace::instant("comm issue", "all_reduce",
                   fmt::format(R"("group":"dp[0,1]","seq":{},"bytes":{})", n, 4 << 20));
    trace::complete("comm", "all_reduce", begin, trace::Clock::now(),
                    fmt::format(R"("group":"dp[0,1]","seq":{},"bytes":{})", n, 4 << 20));
    drop_recorded_every(state, n);
  }
  trace::stop();
  trace::take();
}
BENCHMARK(BM_CommCallOn);

}  // namespace
}  // namespace meshtrain

BENCHMARK_MAIN();
