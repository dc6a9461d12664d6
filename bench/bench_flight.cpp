// The flight recorder's cost per communication call (issue + start + finish,
// the three updates every call makes) and the cost of one dump of a full ring
// (what a rank spends when a deadline passes). Per step: calls per step x the
// first (docs/benchmarks.md).
#include <benchmark/benchmark.h>

#include "meshtrain/comm/flight_dump.h"
#include "meshtrain/comm/flight_recorder.h"

namespace meshtrain {
namespace {

void BM_RecordCall(benchmark::State& state) {
  FlightRecorder recorder(static_cast<size_t>(state.range(0)));
  const int comm = recorder.add_comm({"dp", {0, 1}, 0});
  recorder.set_timeout(300);
  CallRecord call;
  call.op = CommOp::all_reduce;
  call.bytes = 4 << 20;
  for (auto _ : state) {
    call.submitted = CommClock::now();
    const uint64_t id = recorder.issue(comm, call);
    call.started = CommClock::now();
    recorder.start(id, call.started);
    call.finished = CommClock::now();
    recorder.finish(id, call, false);
    ++call.seq;
  }
}
BENCHMARK(BM_RecordCall)->Arg(0)->Arg(1024);

void BM_DumpFullRing(benchmark::State& state) {
  FlightRecorder recorder(1024);
  const int comm = recorder.add_comm({"dp", {0, 1}, 0});
  CallRecord call;
  for (int i = 0; i < 1100; ++i) {
    call.seq = static_cast<uint64_t>(i);
    const uint64_t id = recorder.issue(comm, call);
    recorder.start(id, CommClock::now());
    recorder.finish(id, call, false);
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(flight_dump_json(recorder.snapshot(), {0, 2, "job", "timeout", 0}));
  }
}
BENCHMARK(BM_DumpFullRing)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace meshtrain

BENCHMARK_MAIN();
