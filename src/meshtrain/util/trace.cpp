#include "meshtrain/util/trace.h"

#include <memory>
#include <mutex>

namespace meshtrain::trace {

namespace detail {
std::atomic<bool> recording{false};
}

namespace {

struct Buffer {
  std::mutex mutex;  // the owner thread and take(): uncontended while recording
  int tid = 0;
  std::string name;
  std::vector<Event> events;
};

// The process-wide registry of thread buffers (recording is a process-wide
// switch by design: span sites in every module must not need a context).
struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Buffer>> buffers;
  std::atomic<int64_t> epoch_ns{0};
};

Registry& registry() {
  static Registry r;
  return r;
}

Buffer& this_thread_buffer() {
  thread_local std::shared_ptr<Buffer> buffer = [] {
    auto b = std::make_shared<Buffer>();
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    b->tid = static_cast<int>(r.buffers.size()) + 1;
    b->name = fmt::format("thread {}", b->tid);
    r.buffers.push_back(b);
    return b;
  }();
  return *buffer;
}

int64_t since_epoch(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count() -
         registry().epoch_ns.load(std::memory_order_relaxed);
}

void push(Event event) {
  Buffer& b = this_thread_buffer();
  std::lock_guard lock(b.mutex);
  b.events.push_back(std::move(event));
}

// Microseconds with nanosecond digits: exact, so nested spans stay nested.
std::string micros(int64_t ns) {
  const char* sign = ns < 0 ? "-" : "";
  const int64_t a = ns < 0 ? -ns : ns;
  return fmt::format("{}{}.{:03}", sign, a / 1000, a % 1000);
}

}  // namespace

void set_thread_name(std::string_view name) {
  Buffer& b = this_thread_buffer();
  std::lock_guard lock(b.mutex);
  b.name = std::string(name);
}

void start(Clock::time_point epoch) {
  Registry& r = registry();
  {
    std::lock_guard lock(r.mutex);
    for (auto& b : r.buffers) {
      std::lock_guard buffer_lock(b->mutex);
      b->events.clear();
    }
  }
  r.epoch_ns.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(epoch.time_since_epoch()).count());
  detail::recording.store(true);
}

void stop() { detail::recording.store(false); }

Clock::time_point epoch() {
  return Clock::time_point(std::chrono::nanoseconds(registry().epoch_ns.load()));
}

std::vector<ThreadEvents> take() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<ThreadEvents> out;
  for (auto& b : r.buffers) {
    std::lock_guard buffer_lock(b->mutex);
    out.push_back(ThreadEvents{b->tid, b->name, std::move(b->events)});
    b->events.clear();
  }
  return out;
}

void complete(const char* cat, std::string name, Clock::time_point begin, Clock::time_point end,
              std::string args) {
  if (!enabled()) return;
  push(Event{'X', cat, std::move(name), since_epoch(begin),
             std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin).count(), 0,
             std::move(args)});
}

void instant(const char* cat, std::string name, std::string args) {
  if (!enabled()) return;
  push(Event{'i', cat, std::move(name), since_epoch(Clock::now()), 0, 0, std::move(args)});
}

void async_span(const char* cat, std::string name, uint64_t id, Clock::time_point begin,
                Clock::time_point end, std::string args) {
  if (!enabled()) return;
  push(Event{'b', cat, name, since_epoch(begin), 0, id, args});
  push(Event{'e', cat, std::move(name), since_epoch(end), 0, id, std::move(args)});
}

void Span::finish() {
  const Clock::time_point end = Clock::now();
  std::string name = index_ >= 0 ? fmt::format("{} {}", name_, index_) : std::string(name_);
  push(Event{'X', cat_, std::move(name), since_epoch(begin_),
             std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin_).count(), 0,
             std::move(args_)});
}

std::string quote(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

std::string events_json(int pid, std::string_view process_name,
                        const std::vector<ThreadEvents>& threads) {
  std::string out;
  auto add = [&](const std::string& event) {
    if (!out.empty()) out += ",\n";
    out += event;
  };
  add(fmt::format(R"({{"ph":"M","pid":{},"tid":0,"name":"process_name","args":{{"name":{}}}}})",
                  pid, quote(process_name)));
  add(fmt::format(R"({{"ph":"M","pid":{},"tid":0,"name":"process_sort_index","args":{{"sort_index":{}}}}})",
                  pid, pid));
  for (const ThreadEvents& t : threads) {
    add(fmt::format(R"({{"ph":"M","pid":{},"tid":{},"name":"thread_name","args":{{"name":{}}}}})",
                    pid, t.tid, quote(t.name)));
    for (const Event& e : t.events) {
      std::string event = fmt::format(R"({{"ph":"{}","pid":{},"tid":{},"cat":{},"name":{},"ts":{})",
                                      e.ph, pid, t.tid, quote(e.cat), quote(e.name),
                                      micros(e.ts_ns));
      if (e.ph == 'X') event += fmt::format(R"(,"dur":{})", micros(e.dur_ns));
      if (e.ph == 'b' || e.ph == 'e') event += fmt::format(R"(,"id":{})", e.id);
      if (e.ph == 'i') event += R"(,"s":"t")";
      if (!e.args.empty()) event += fmt::format(R"(,"args":{{{}}})", e.args);
      event += '}';
      add(event);
    }
  }
  return out;
}

std::string file_json(const std::vector<std::string>& event_bodies, std::string_view other_json) {
  std::string out = "{\"traceEvents\":[\n";
  bool first = true;
  for (const std::string& body : event_bodies) {
    if (body.empty()) continue;
    if (!first) out += ",\n";
    out += body;
    first = false;
  }
  out += fmt::format("\n],\"displayTimeUnit\":\"ms\",\"otherData\":{}}}\n",
                     other_json.empty() ? "{}" : other_json);
  return out;
}

}  // namespace meshtrain::trace
