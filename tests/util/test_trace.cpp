// The tracer (util/trace.h): off records nothing, spans nest per thread,
// threads keep their names and buffers, the JSON it writes parses.
#include "meshtrain/util/trace.h"

#include <gtest/gtest.h>

#include <thread>

namespace meshtrain::trace {
namespace {

const ThreadEvents* find_thread(const std::vector<ThreadEvents>& threads, const std::string& name) {
  for (const ThreadEvents& t : threads) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST(Trace, OffRecordsNothing) {
  stop();
  take();
  { Span span("forward", "layer", 0); }
  instant("comm issue", "all_reduce");
  complete("comm", "all_reduce", Clock::now(), Clock::now());
  for (const ThreadEvents& t : take()) EXPECT_TRUE(t.events.empty()) << t.name;
}

TEST(Trace, SpansNestAndThreadsKeepTheirNames) {
  set_thread_name("test main");
  start(Clock::now());
  {
    Span outer("step", "step", 1);
    {
      Span inner("forward", "layer", 3);
      inner.args(R"("micro_batch":{})", 2);
    }
    Span early("step", "optimizer");
    early.end();
    early.end();  // once
  }
  std::thread worker([] {
    set_thread_name("worker");
    Span span("offload", "read");
  });
  worker.join();  // its buffer outlives it
  stop();
  { Span after("step", "after stop"); }
  const std::vector<ThreadEvents> threads = take();
  const ThreadEvents* main = find_thread(threads, "test main");
  const ThreadEvents* other = find_thread(threads, "worker");
  ASSERT_NE(main, nullptr);
  ASSERT_NE(other, nullptr);
  ASSERT_EQ(main->events.size(), 3u);  // inner, optimizer, outer: in order of ending
  const Event& inner = main->events[0];
  const Event& outer = main->events[2];
  EXPECT_EQ(inner.name, "layer 3");
  EXPECT_EQ(inner.args, R"("micro_batch":2)");
  EXPECT_EQ(main->events[1].name, "optimizer");
  EXPECT_EQ(outer.name, "step 1");
  EXPECT_GE(inner.ts_ns, outer.ts_ns);
  EXPECT_LE(inner.ts_ns + inner.dur_ns, outer.ts_ns + outer.dur_ns);
  ASSERT_EQ(other->events.size(), 1u);
  EXPECT_EQ(other->events[0].name, "read");
  EXPECT_NE(main->tid, other->tid);
}

TEST(Trace, JsonEscapesAndKeepsNanoseconds) {
  EXPECT_EQ(quote("a\"b\\c\n"), R"("a\"b\\c\n")");
  ThreadEvents t{7, "comm", {}};
  t.events.push_back(Event{'X', "comm", "all_reduce", 1234567, 1001, 0, R"("seq":3)"});
  t.events.push_back(Event{'b', "p2p", "send_recv", 5, 0, 9, {}});
  const std::string body = events_json(2, "rank 2", {t});
  EXPECT_NE(body.find(R"("ts":1234.567,"dur":1.001,"args":{"seq":3})"), std::string::npos) << body;
  EXPECT_NE(body.find(R"("id":9)"), std::string::npos) << body;
  EXPECT_NE(body.find(R"("name":"thread_name","args":{"name":"comm"})"), std::string::npos);
  const std::string file = file_json({body, "", body}, R"({"rank":2})");
  EXPECT_EQ(file.rfind("{\"traceEvents\":[", 0), 0u);
  EXPECT_NE(file.find(R"("otherData":{"rank":2}})"), std::string::npos);
  EXPECT_EQ(file.find(",\n,"), std::string::npos);  // empty bodies leave no empty element
}

}  // namespace
}  // namespace meshtrain::trace
