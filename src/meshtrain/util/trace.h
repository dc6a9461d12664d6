// Timeline tracing: spans, instants and asynchronous spans recorded per thread
// and written as Chrome trace-event JSON (what ui.perfetto.dev and
// chrome://tracing open). docs/trace.md.
//
// Contract:
// - The recorder is process-wide and off by default. Every site checks one
//   relaxed atomic; when off a span costs that load and nothing else (no
//   clock read, no allocation).
// - Each thread appends to its own buffer (registered once, on its first
//   event or set_thread_name); the buffer's mutex is only ever contended by
//   take(), which runs after stop(). Buffers outlive their threads.
// - Spans on one thread nest (RAII); an event whose time range may overlap
//   others on its thread (a posted point-to-point batch) is an asynchronous
//   span, drawn on a track of its own.
// - Times are steady_clock, written in microseconds since the epoch given to
//   start() (the trainer passes a barrier-aligned instant, so every rank's
//   file shares one clock).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace meshtrain::trace {

using Clock = std::chrono::steady_clock;

namespace detail {
extern std::atomic<bool> recording;
}

inline bool enabled() { return detail::recording.load(std::memory_order_relaxed); }

// One recorded event. ph: 'X' complete span, 'i' instant, 'b'/'e' async
// begin/end (id), 'C' counter (args hold the values).
struct Event {
  char ph = 'X';
  const char* cat = "";
  std::string name;
  int64_t ts_ns = 0;   // since the epoch
  int64_t dur_ns = 0;  // 'X' only
  uint64_t id = 0;     // 'b' / 'e' only
  std::string args;    // the body of a JSON object ("\"seq\":3,\"bytes\":8"), or empty
};

struct ThreadEvents {
  int tid = 0;  // 1.. in order of registration
  std::string name;
  std::vector<Event> events;
};

// Names the calling thread's track ("main", "comm", "loader", ...); works
// whether recording or not, so threads can be named when they start.
void set_thread_name(std::string_view name);

// Clears every buffer, sets the epoch and turns recording on.
void start(Clock::time_point epoch);
// Turns recording off (events in progress on other threads may still land
// until they finish; take() waits for each buffer's writer).
void stop();
// Moves every thread's events out (threads without events included, for their names).
std::vector<ThreadEvents> take();
Clock::time_point epoch();

// Recording sites. Names are copied only when recording.
void complete(const char* cat, std::string name, Clock::time_point begin, Clock::time_point end,
              std::string args = {});
void instant(const char* cat, std::string name, std::string args = {});
void async_span(const char* cat, std::string name, uint64_t id, Clock::time_point begin,
                Clock::time_point end, std::string args = {});

// A JSON string literal (quotes included) for args.
std::string quote(std::string_view text);

// The events of one process as trace-event JSON objects, comma separated (no
// brackets), with its process and thread names as metadata events: a per-rank
// file and the merged file are both built from these.
std::string events_json(int pid, std::string_view process_name,
                        const std::vector<ThreadEvents>& threads);
// A whole file: {"traceEvents":[<bodies joined>],"displayTimeUnit":"ms","otherData":<other>}.
std::string file_json(const std::vector<std::string>& event_bodies, std::string_view other_json);

// A span on the calling thread from construction to destruction:
//   trace::Span span("forward", "layer", 3);   // "layer 3"
//   span.args("\"micro_batch\":{}", mb);        // only formatted when recording
class Span {
 public:
  Span(const char* cat, const char* name, int64_t index = -1) : active_(enabled()) {
    if (active_) {
      cat_ = cat;
      name_ = name;
      index_ = index;
      begin_ = Clock::now();
    }
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  ~Span() {
    if (active_) finish();
  }
  bool active() const { return active_; }
  // Ends the span before the scope does (once).
  void end() {
    if (active_) finish();
    active_ = false;
  }
  template <typename... A>
  void args(fmt::format_string<A...> format, A&&... a) {
    if (active_) args_ = fmt::format(format, std::forward<A>(a)...);
  }

 private:
  void finish();
  bool active_;
  const char* cat_ = nullptr;
  const char* name_ = nullptr;
  int64_t index_ = -1;
  Clock::time_point begin_;
  std::string args_;
};

}  // namespace meshtrain::trace
