// The distributed, resumable training loader. Every rank walks the same global
// order (sampler.h) in global batches of G sequences; data-parallel rank r of
// dp takes the contiguous share [r*G/dp, (r+1)*G/dp) of each batch and hands
// it out as micro-batches of m rows. Tensor- and pipeline-parallel peers pass
// the same dp_rank and so get the same rows. The state is the global position
// of the next step, so a run may resume with another dp (or m) and continue at
// the same global sample. A background thread keeps `prefetch` micro-batches
// ready; an error there reaches the consumer as the same Error from next().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "meshtrain/data/sampler.h"
#include "meshtrain/util/context_split.h"

namespace meshtrain {

struct LoaderOptions {
  int64_t global_batch = 1;  // G: sequences per optimizer step over all data-parallel ranks
  int64_t micro_batch = 1;   // m: rows per micro-batch on this rank
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  // Context parallelism: each row cut to this cp rank's tokens (read_micro_batch).
  ContextSplit context;
  uint64_t seed = 0;
  int prefetch = 2;  // micro-batches made ahead on a background thread; 0 = made in next()
  double produce_delay_ms = 0;  // test hook (MESHTRAIN_SLOW_RANK): a sleep per micro-batch made
};

// Checks the split of G over dp ranks and micro-batches (an Error names
// train.batch_size, train.micro_batch_size and dp) and returns G / dp.
int64_t rank_share(const LoaderOptions& options);

struct MicroBatch {
  int64_t rows = 0, seq_len = 0;
  std::vector<int32_t> inputs, targets;  // rows x seq_len, row-major
  std::vector<int32_t> positions;        // rows x seq_len (SampleSource::has_positions), else empty
  std::vector<int64_t> samples;          // each row's sample index in the source
};

// Reads the samples listed in out.samples into out's rows (resizing them).
// Under context parallelism (context.active()) each row holds this rank's
// tokens only (seq_len = seq / cp; targets cut from the whole row's shifted
// ones) and positions are always filled: record-local in packed rows, each
// token's global index otherwise.
void read_micro_batch(const SampleSource& source, MicroBatch& out,
                      const ContextSplit& context = {});
// The batch's record positions for Model passes, or nullptr (one sequence per row).
inline const int32_t* positions_of(const MicroBatch& b) {
  return b.positions.empty() ? nullptr : b.positions.data();
}
// Targets that count in the loss (>= 0).
int64_t count_loss_tokens(const MicroBatch& b);

struct LoaderStats {
  int64_t micro_batches = 0;    // handed to the consumer
  double wait_seconds = 0;      // the consumer blocked in next()
  double produce_seconds = 0;   // spent making micro-batches (on whichever thread)
};

class DataLoader {
 public:
  // `source` must outlive the loader. Starts at `start` (a checkpoint's
  // position; any G may have written it).
  DataLoader(const SampleSource& source, const LoaderOptions& options, SamplerPosition start = {});
  ~DataLoader();  // stops and joins the prefetch thread
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // This rank's next micro-batch; valid until the next call. Throws the Error
  // that making it raised (again on every later call).
  const MicroBatch& next();

  // Micro-batches per optimizer step on this rank: G / dp / m.
  int64_t micro_batches_per_step() const { return steps_micro_; }
  // The global position of the first step not completely handed out (what a
  // checkpoint saves between steps).
  SamplerPosition position() const;
  // Loss tokens (SampleSource::loss_tokens) of that step's whole global batch,
  // every dp rank's rows: the same on every rank, known before its backward.
  int64_t step_loss_tokens() const;
  const GlobalOrder& order() const { return order_; }
  LoaderStats stats() const;

 private:
  // Where the producer is: the step's batch start and the micro-batch in it.
  struct Cursor {
    SamplerPosition batch;
    int64_t micro = 0;
  };
  void produce(Cursor& cursor, MicroBatch& out) const;
  void advance(Cursor& cursor) const;
  void producer_loop();

  const SampleSource& source_;
  LoaderOptions options_;
  GlobalOrder order_;
  int64_t share_ = 0, steps_micro_ = 0;
  Cursor consumed_;  // the consumer's view: micro-batches handed out
  Cursor produced_;  // the producer's: owned by the producer thread once it runs

  std::vector<MicroBatch> slots_;  // prefetch + 1 (one is held by the consumer)
  mutable std::mutex mutex_;
  std::condition_variable ready_cv_, free_cv_;
  std::deque<size_t> ready_, free_;
  int64_t held_ = -1;  // the slot the consumer reads, or -1
  bool stop_ = false;
  std::exception_ptr error_;
  LoaderStats stats_;
  std::thread producer_;
};

// The fixed validation set: the first batches x G windows of `source` in file
// order (wrapping around a shorter source), unshuffled, split across ranks like
// training batches: this rank's rows of each batch, in micro-batches of m rows.
class ValidationSet {
 public:
  ValidationSet(const SampleSource& source, const LoaderOptions& options, int64_t batches);
  int64_t num_micro_batches() const { return num_micro_; }
  const SampleSource& source() const { return source_; }
  // Micro-batch k (0 <= k < num_micro_batches()) of this rank.
  void read(int64_t k, MicroBatch& out) const;
  // Every sample some dp rank's micro-batches read, once each, ascending.
  std::vector<int64_t> samples_of_every_rank() const;

 private:
  // The sample in `row` of micro-batch k of dp rank `rank`.
  int64_t sample(int64_t k, int64_t rank, int64_t row) const;

  const SampleSource& source_;
  LoaderOptions options_;
  int64_t share_ = 0, per_batch_ = 0, num_micro_ = 0;
};

}  // namespace meshtrain
