#include "meshtrain/data/loader.h"

#include <algorithm>
#include <chrono>

#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int64_t rank_share(const LoaderOptions& o) {
  MESHTRAIN_CHECK(o.dp_size >= 1 && o.dp_rank >= 0 && o.dp_rank < o.dp_size,
                  "data: data-parallel rank {} out of range for dp = {}", o.dp_rank, o.dp_size);
  MESHTRAIN_CHECK(o.global_batch >= 1 && o.micro_batch >= 1,
                  "data: train.batch_size ({}) and train.micro_batch_size ({}) must be >= 1",
                  o.global_batch, o.micro_batch);
  MESHTRAIN_CHECK(o.global_batch % o.dp_size == 0,
                  "data: train.batch_size ({}) must be divisible by the data-parallel size dp = {}",
                  o.global_batch, o.dp_size);
  int64_t share = o.global_batch / o.dp_size;
  MESHTRAIN_CHECK(share % o.micro_batch == 0,
                  "data: train.batch_size ({}) / dp ({}) = {} sequences per rank must be a multiple "
                  "of train.micro_batch_size ({})",
                  o.global_batch, o.dp_size, share, o.micro_batch);
  return share;
}

void read_micro_batch(const SampleSource& source, MicroBatch& out, const ContextSplit& context) {
  const int64_t seq = source.seq_len();
  out.rows = static_cast<int64_t>(out.samples.size());
  out.seq_len = seq;
  const bool positions = source.has_positions() || context.active();
  out.inputs.resize(static_cast<size_t>(out.rows * seq));
  out.targets.resize(out.inputs.size());
  out.positions.resize(positions ? out.inputs.size() : 0);
  for (int64_t row = 0; row < out.rows; ++row) {
    const int64_t sample = out.samples[static_cast<size_t>(row)];
    source.read_sample(sample, out.inputs.data() + row * seq, out.targets.data() + row * seq);
    int32_t* pos = out.positions.data() + row * seq;
    if (source.has_positions()) {
      source.read_positions(sample, pos);
    } else if (positions) {
      for (int64_t t = 0; t < seq; ++t) pos[t] = static_cast<int32_t>(t);
    }
  }
  if (!context.active()) return;
  // The whole rows were read (targets shifted on them); keep this rank's tokens.
  MESHTRAIN_CHECK(seq % (2 * context.size) == 0,
                  "data: sequence length {} is not divisible by 2 x parallel.cp = {}", seq,
                  2 * context.size);
  const int64_t local = context.local(seq);
  for (std::vector<int32_t>* v : {&out.inputs, &out.targets, &out.positions}) {
    std::vector<int32_t> mine(static_cast<size_t>(out.rows * local));
    context.cut(v->data(), mine.data(), out.rows, seq);
    *v = std::move(mine);
  }
  out.seq_len = local;
}

int64_t count_loss_tokens(const MicroBatch& b) {
  int64_t n = 0;
  for (int32_t t : b.targets) n += t >= 0 ? 1 : 0;
  return n;
}

DataLoader::DataLoader(const SampleSource& source, const LoaderOptions& options,
                       SamplerPosition start)
    : source_(source),
      options_(options),
      order_(source.num_samples(), options.seed, options.global_batch) {
  share_ = rank_share(options_);
  steps_micro_ = share_ / options_.micro_batch;
  MESHTRAIN_CHECK(options_.prefetch >= 0, "data: prefetch depth must be >= 0, got {}",
                  options_.prefetch);
  consumed_.batch = order_.batch_start(start);  // validates the position
  produced_ = consumed_;
  slots_.resize(static_cast<size_t>(options_.prefetch) + 1);
  for (size_t i = 0; i < slots_.size(); ++i) free_.push_back(i);
  if (options_.prefetch > 0) {
    producer_ = std::thread([this] {
      trace::set_thread_name("loader");
      producer_loop();
    });
  }
}

DataLoader::~DataLoader() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  free_cv_.notify_all();
  if (producer_.joinable()) producer_.join();
}

void DataLoader::produce(Cursor& cursor, MicroBatch& out) const {
  KeyedPermutation order = order_.order(cursor.batch.epoch);
  int64_t first = cursor.batch.index + options_.dp_rank * share_ + cursor.micro * options_.micro_batch;
  out.samples.resize(static_cast<size_t>(options_.micro_batch));
  for (int64_t row = 0; row < options_.micro_batch; ++row) {
    out.samples[static_cast<size_t>(row)] =
        static_cast<int64_t>(order(static_cast<uint64_t>(first + row)));
  }
  read_micro_batch(source_, out, options_.context);
  if (options_.produce_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(options_.produce_delay_ms));
  }
}

void DataLoader::advance(Cursor& cursor) const {
  if (++cursor.micro == steps_micro_) {
    cursor.micro = 0;
    cursor.batch = order_.next_batch(cursor.batch);
  }
}

void DataLoader::producer_loop() {
  for (;;) {
    size_t slot = 0;
    {
      std::unique_lock lock(mutex_);
      free_cv_.wait(lock, [&] { return stop_ || !free_.empty(); });
      if (stop_) return;
      slot = free_.front();
      free_.pop_front();
    }
    auto start = std::chrono::steady_clock::now();
    try {
      trace::Span span("data", "produce micro-batch");
      produce(produced_, slots_[slot]);
      advance(produced_);
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      ready_cv_.notify_all();
      return;
    }
    double took = seconds_since(start);
    {
      std::lock_guard lock(mutex_);
      stats_.produce_seconds += took;
      ready_.push_back(slot);
    }
    ready_cv_.notify_one();
  }
}

const MicroBatch& DataLoader::next() {
  trace::Span span("data", "data wait");
  auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  if (held_ >= 0) {
    free_.push_back(static_cast<size_t>(held_));
    held_ = -1;
    free_cv_.notify_one();
  }
  if (options_.prefetch == 0) {
    // Synchronous: make it here (errors propagate directly, and again next time).
    if (error_) std::rethrow_exception(error_);
    size_t slot = free_.front();
    free_.pop_front();
    try {
      produce(produced_, slots_[slot]);
    } catch (...) {
      error_ = std::current_exception();
      free_.push_back(slot);
      throw;
    }
    advance(produced_);
    stats_.produce_seconds += seconds_since(start);
    ready_.push_back(slot);
  }
  ready_cv_.wait(lock, [&] { return !ready_.empty() || error_ != nullptr; });
  // Micro-batches made before an error are still handed out, as a synchronous read would.
  if (ready_.empty()) std::rethrow_exception(error_);
  held_ = static_cast<int64_t>(ready_.front());
  ready_.pop_front();
  advance(consumed_);
  ++stats_.micro_batches;
  stats_.wait_seconds += seconds_since(start);
  return slots_[static_cast<size_t>(held_)];
}

SamplerPosition DataLoader::position() const {
  std::lock_guard lock(mutex_);
  return consumed_.batch;
}

int64_t DataLoader::step_loss_tokens() const {
  const SamplerPosition batch = position();
  const KeyedPermutation order = order_.order(batch.epoch);
  int64_t tokens = 0;
  for (int64_t i = 0; i < options_.global_batch; ++i) {
    tokens += source_.loss_tokens(static_cast<int64_t>(order(static_cast<uint64_t>(batch.index + i))));
  }
  return tokens;
}

LoaderStats DataLoader::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

ValidationSet::ValidationSet(const SampleSource& source, const LoaderOptions& options,
                             int64_t batches)
    : source_(source), options_(options) {
  MESHTRAIN_CHECK(batches >= 1, "data: validation needs at least one batch, got {}", batches);
  share_ = rank_share(options_);
  per_batch_ = share_ / options_.micro_batch;
  num_micro_ = batches * per_batch_;
}

void ValidationSet::read(int64_t k, MicroBatch& out) const {
  MESHTRAIN_CHECK(k >= 0 && k < num_micro_, "data: validation micro-batch {} out of range [0, {})",
                  k, num_micro_);
  out.samples.resize(static_cast<size_t>(options_.micro_batch));
  for (int64_t row = 0; row < options_.micro_batch; ++row) {
    out.samples[static_cast<size_t>(row)] = sample(k, options_.dp_rank, row);
  }
  read_micro_batch(source_, out, options_.context);
}

int64_t ValidationSet::sample(int64_t k, int64_t rank, int64_t row) const {
  const int64_t batch = k / per_batch_, micro = k % per_batch_;
  return (batch * options_.global_batch + rank * share_ + micro * options_.micro_batch + row) %
         source_.num_samples();
}

std::vector<int64_t> ValidationSet::samples_of_every_rank() const {
  std::vector<int64_t> out;
  for (int64_t k = 0; k < num_micro_; ++k) {
    for (int64_t rank = 0; rank < options_.dp_size; ++rank) {
      for (int64_t row = 0; row < options_.micro_batch; ++row) out.push_back(sample(k, rank, row));
    }
  }
  std::ranges::sort(out);
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace meshtrain
