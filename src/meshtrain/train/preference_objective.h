// Preference optimisation as a step objective (step_runner.h StepObjective):
// for each micro-batch of preference rows (data/preference.h) the reference's
// token losses from a forward-only pass (or a precomputed table), then the
// training pass, whose own token losses give each pair's loss and rewards
// (preference.h dpo_pair_loss) and the per-token loss weights carrying
// d(loss)/d(log π) into its backward (TokenLoss::weigh):
//   log π(response) = −Σ its token losses, so a token of a pair's chosen
//   response weighs −∂loss/∂log πθ(c), one of its rejected −∂loss/∂log πθ(r).
// A step's loss is the mean over its pairs (a preference row's loss_tokens
// are its pairs, so the trainer's grad_scale is 1 / pairs of the step).
//
// The reference: the model with its LoRA adapters switched off (one more
// forward pass per micro-batch, no second copy), or a table of every sample's
// reference log-probabilities computed once before the first step and stored
// with the run in <out_dir>/reference_logps.safetensors
// (dpo.precompute_reference): a resumed run reads it back; a LoRA run that
// lacks it recomputes it with the adapters off.
//
// Validation (data.val, preference rows too) reports the mean DPO loss over
// the validation pairs: the policy's forward pass against the reference's
// (adapters off, or a second table in the same file, over the samples the
// validation set reads, computed with the training table).
//
// Costs per micro-batch: the reference forward (unless precomputed) and the
// training forward + backward with one more classifier forward (the weights
// must exist before the fused classifier computes its gradients).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/data/sampler.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/preference.h"
#include "meshtrain/train/step_runner.h"

namespace meshtrain {

// The file in train.out_dir holding a run's precomputed reference.
inline constexpr const char* kReferenceLogpsFile = "reference_logps.safetensors";

// Each token's response in a preference row: 2k for pair k's chosen, 2k + 1
// for its rejected, -1 for tokens outside the loss. Segments begin where
// positions restart at 0; those with loss tokens alternate chosen, rejected.
// Error when a row's responses do not pair up. Returns the row's pairs.
int64_t row_responses(const int32_t* targets, const int32_t* positions, int64_t seq,
                      int32_t* response);

// Every sample's reference log-probabilities (2 per pair, in row order),
// indexed by sample. Stored as tensors <prefix>logps and <prefix>offsets.
class ReferenceLogps {
 public:
  ReferenceLogps() = default;
  explicit ReferenceLogps(const SampleSource& source);  // zeros, sized for `source`
  std::span<double> of(int64_t sample);
  std::vector<double>& values() { return values_; }
  void add_to(SafetensorsWriter& out, const std::string& prefix) const;
  static bool stored_in(const SafetensorsReader& in, const std::string& prefix);
  // Error (corrupt) naming `in` when the stored table does not match `source`'s rows.
  static ReferenceLogps load(const SafetensorsReader& in, const std::string& prefix,
                             const SampleSource& source);

 private:
  std::vector<int64_t> offsets_;  // [samples + 1]
  std::vector<double> values_;
};

class PreferenceObjective final : public StepObjective {
 public:
  // `mesh` and `val` may be null (one process; no validation); `source`,
  // `val`, its source and `model` outlive it.
  PreferenceObjective(const TrainConfig& config, Model& model, const SampleSource& source,
                      const ValidationSet* val, const LoaderOptions& loader, DeviceMesh* mesh);
  void start(StepRunner& runner, bool resumed) override;
  void prepare(std::span<const MicroBatch> batches, StepRunner& runner) override;
  TokenLoss token_loss(size_t k) override;
  double finish(Communicator* stages, Communicator* dp, StepRecord& r) override;
  double evaluate(const ValidationSet& val, StepRunner& runner, int64_t& units) override;

 private:
  // Micro-batch k's pairs from the policy's token losses: their losses and
  // rewards summed, and the token weights.
  void weigh(size_t k, const float* policy, float* weights);
  // Row `row` of `b` (read from `source`): each of this rank's tokens'
  // response (row_responses; under context parallelism those of the whole
  // row, cut like its tokens); returns the row's pairs.
  int64_t responses_of(const SampleSource& source, const MicroBatch& b, int64_t row,
                       int32_t* response) const;
  // Each row's pairs' losses from the policy's token losses of `b` and the
  // reference's (`reference`: its token losses, or null: `table`);
  // responses_ then holds each row's response map. Under context parallelism
  // a response's sums are all-reduced over the cp group first (collective),
  // so every cp rank has every pair's loss.
  std::vector<std::vector<PairLoss>> batch_pairs(const SampleSource& source, const MicroBatch& b,
                                                 const float* policy, const float* reference,
                                                 ReferenceLogps& table);
  // `table` from forward passes over `samples` of `source` (collective).
  void precompute(StepRunner& runner, const SampleSource& source,
                  const std::vector<int64_t>& samples, ReferenceLogps& table);

  DpoSettings settings_;
  bool precomputed_;
  std::string path_;  // the stored reference table
  Model& model_;
  const SampleSource& source_;
  LoaderOptions loader_;
  DeviceMesh* mesh_;
  const ValidationSet* val_;
  ContextSplit cp_;  // this rank's part of each row (loader.context)
  ReferenceLogps table_, val_table_;
  std::span<const MicroBatch> batches_;  // the step's (prepare to finish)
  std::vector<std::vector<float>> reference_;  // their reference token losses
  std::vector<int32_t> response_;
  std::vector<std::vector<int32_t>> responses_;  // batch_pairs' rows
  // The step's sums on this rank: pair losses, chosen and rejected rewards,
  // correct pairs, pairs.
  double loss_ = 0, chosen_ = 0, rejected_ = 0, correct_ = 0, pairs_ = 0;
};

// The objective config asks for (null: the token losses' sum).
std::unique_ptr<StepObjective> make_step_objective(const TrainConfig& config, Model& model,
                                                   const SampleSource& source,
                                                   const ValidationSet* val,
                                                   const LoaderOptions& loader, DeviceMesh* mesh);

}  // namespace meshtrain
