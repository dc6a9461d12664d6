#include "meshtrain/train/preference_objective.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <optional>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

// The model's adapters off while it exists: the reference policy.
class AdaptersOff {
 public:
  explicit AdaptersOff(Model& model) : model_(model) { model_.set_adapters_enabled(false); }
  ~AdaptersOff() { model_.set_adapters_enabled(true); }
  AdaptersOff(const AdaptersOff&) = delete;
  AdaptersOff& operator=(const AdaptersOff&) = delete;

 private:
  Model& model_;
};

// Each response's summed log-probability (minus its token losses) and token
// count in one row.
struct RowResponses {
  std::vector<double> logps;
  std::vector<int64_t> tokens;
};

RowResponses sum_responses(const int32_t* response, const float* losses, int64_t seq,
                           int64_t pairs) {
  RowResponses out{std::vector<double>(static_cast<size_t>(2 * pairs)),
                   std::vector<int64_t>(static_cast<size_t>(2 * pairs))};
  for (int64_t t = 0; t < seq; ++t) {
    if (response[t] < 0) continue;
    out.logps[static_cast<size_t>(response[t])] -= losses[t];
    ++out.tokens[static_cast<size_t>(response[t])];
  }
  return out;
}

}  // namespace

int64_t row_responses(const int32_t* targets, const int32_t* positions, int64_t seq,
                      int32_t* response) {
  MESHTRAIN_CHECK(positions != nullptr, "preference: rows without positions (not preference rows)");
  int32_t segment_response = -1;  // the current segment's response, once it has a loss token
  int32_t responses = 0;
  bool started = false;  // the current segment has its response
  for (int64_t t = 0; t < seq; ++t) {
    if (positions[t] == 0) started = false;
    if (targets[t] < 0) {
      response[t] = -1;
      continue;
    }
    if (!started) {
      segment_response = responses++;
      started = true;
    }
    response[t] = segment_response;
  }
  MESHTRAIN_CHECK(responses % 2 == 0,
                  "preference: a row with {} responses (chosen and rejected must pair up)",
                  responses);
  return responses / 2;
}

ReferenceLogps::ReferenceLogps(const SampleSource& source) {
  offsets_.push_back(0);
  for (int64_t i = 0; i < source.num_samples(); ++i) {
    offsets_.push_back(offsets_.back() + 2 * source.loss_tokens(i));
  }
  values_.assign(static_cast<size_t>(offsets_.back()), 0.0);
}

std::span<double> ReferenceLogps::of(int64_t sample) {
  const auto i = static_cast<size_t>(sample);
  return std::span(values_).subspan(static_cast<size_t>(offsets_[i]),
                                    static_cast<size_t>(offsets_[i + 1] - offsets_[i]));
}

void ReferenceLogps::add_to(SafetensorsWriter& out, const std::string& prefix) const {
  out.add(prefix + "logps", StDType::F64, {static_cast<int64_t>(values_.size())}, values_.data());
  out.add(prefix + "offsets", StDType::I64, {static_cast<int64_t>(offsets_.size())},
          offsets_.data());
}

bool ReferenceLogps::stored_in(const SafetensorsReader& in, const std::string& prefix) {
  return in.contains(prefix + "logps") && in.contains(prefix + "offsets");
}

ReferenceLogps ReferenceLogps::load(const SafetensorsReader& in, const std::string& prefix,
                                    const SampleSource& source) {
  ReferenceLogps table(source);
  const std::vector<int64_t> offsets = in.read_ints(prefix + "offsets");
  const StTensorInfo& logps = in.info(prefix + "logps");
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt,
                     offsets == table.offsets_ && logps.dtype == StDType::F64 &&
                         logps.numel() == static_cast<int64_t>(table.values_.size()),
                     "preference: '{}' holds the reference log-probabilities of other data ({}: "
                     "{} responses; this run's has {})",
                     in.path(), prefix + "logps", logps.numel(), table.values_.size());
  in.read_data(logps.begin, table.values_.data(), table.values_.size() * sizeof(double));
  return table;
}

PreferenceObjective::PreferenceObjective(const TrainConfig& config, Model& model,
                                         const SampleSource& source, const ValidationSet* val,
                                         const LoaderOptions& loader, DeviceMesh* mesh)
    : settings_(config.dpo.loss),
      precomputed_(config.dpo.precompute_reference),
      path_((fs::path(config.train.out_dir) / kReferenceLogpsFile).string()),
      model_(model),
      source_(source),
      loader_(loader),
      mesh_(mesh),
      val_(val),
      cp_(loader.context) {}

void PreferenceObjective::start(StepRunner& runner, bool resumed) {
  if (!precomputed_) return;
  std::optional<SafetensorsReader> stored;
  if (fs::exists(path_)) stored.emplace(path_);
  const bool lora = model_.config().lora.enabled();
  bool computed = false;
  auto fill = [&](const std::string& prefix, const SampleSource& source,
                  const std::vector<int64_t>& samples, ReferenceLogps& table) {
    if (stored && ReferenceLogps::stored_in(*stored, prefix)) {
      table = ReferenceLogps::load(*stored, prefix, source);
      return;
    }
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt, !resumed || lora,
                       "preference: '{}' {}: the reference log-probabilities of a resumed full "
                       "fine-tuning run come from its start and cannot be recomputed",
                       path_, stored ? "lacks " + prefix + "logps" : std::string("is missing"));
    std::optional<AdaptersOff> reference;
    if (lora) reference.emplace(model_);
    precompute(runner, source, samples, table);
    computed = true;
  };
  std::vector<int64_t> every(static_cast<size_t>(source_.num_samples()));
  std::iota(every.begin(), every.end(), int64_t{0});
  fill("", source_, every, table_);
  if (val_ != nullptr) fill("val_", val_->source(), val_->samples_of_every_rank(), val_table_);
  stored.reset();
  if (!computed) return;
  Communicator* world = mesh_ != nullptr ? &mesh_->world() : nullptr;
  if (world == nullptr || world->rank() == 0) {
    SafetensorsWriter out;
    table_.add_to(out, "");
    if (val_ != nullptr) val_table_.add_to(out, "val_");
    out.write(path_);
  }
  if (world != nullptr) world->barrier();
}

void PreferenceObjective::precompute(StepRunner& runner, const SampleSource& source,
                                     const std::vector<int64_t>& samples, ReferenceLogps& table) {
  table = ReferenceLogps(source);
  // samples[i] on dp rank i % dp, in micro-batches of the run's rows; every
  // rank runs as many (ZeRO-3 gathers are collective), padding with sample 0
  // whose result is dropped.
  const auto n = static_cast<int64_t>(samples.size());
  const int64_t dp = loader_.dp_size, m = loader_.micro_batch;
  const int64_t per_rank = (n + dp - 1) / dp, micro = (per_rank + m - 1) / m;
  constexpr int64_t kGroup = 8;  // micro-batches per forward_losses call
  const bool head = model_.stage_layers().last;
  std::vector<MicroBatch> batches;
  std::vector<std::vector<float>> losses;
  for (int64_t first = 0; first < micro; first += kGroup) {
    batches.assign(static_cast<size_t>(std::min(kGroup, micro - first)), MicroBatch{});
    for (size_t k = 0; k < batches.size(); ++k) {
      for (int64_t i = 0; i < m; ++i) {
        const int64_t at = ((first + static_cast<int64_t>(k)) * m + i) * dp + loader_.dp_rank;
        batches[k].samples.push_back(at < n ? samples[static_cast<size_t>(at)] : -1);
      }
      std::vector<int64_t> real = batches[k].samples;
      std::ranges::replace(batches[k].samples, int64_t{-1}, int64_t{0});
      read_micro_batch(source, batches[k], cp_);
      batches[k].samples = std::move(real);
    }
    runner.forward_losses(batches, losses);
    if (!head) continue;
    for (size_t k = 0; k < batches.size(); ++k) {
      const MicroBatch& b = batches[k];
      const int64_t seq = b.seq_len;
      response_.resize(static_cast<size_t>(seq));
      for (int64_t row = 0; row < b.rows; ++row) {
        const int64_t sample = b.samples[static_cast<size_t>(row)];
        if (sample < 0) continue;
        const int64_t pairs = responses_of(source, b, row, response_.data());
        const RowResponses sums =
            sum_responses(response_.data(), losses[k].data() + row * seq, seq, pairs);
        std::span<double> out = table.of(sample);
        MESHTRAIN_CHECK(out.size() == sums.logps.size(),
                        "preference: sample {} has {} responses; its row holds {}", sample,
                        out.size(), sums.logps.size());
        std::ranges::copy(sums.logps, out.begin());
      }
    }
  }
  if (mesh_ != nullptr) {
    // Each value came from one dp rank's head stage: sums fill in the rest.
    std::vector<double>& v = table.values();
    for (Communicator* group : {&mesh_->pp(), &mesh_->replicas()}) {
      if (group->size() > 1 && !v.empty()) {
        group->all_reduce(v.data(), static_cast<int64_t>(v.size()), CommDType::f64, ReduceOp::sum);
      }
    }
  }
}

void PreferenceObjective::prepare(std::span<const MicroBatch> batches, StepRunner& runner) {
  batches_ = batches;
  loss_ = chosen_ = rejected_ = correct_ = pairs_ = 0;
  if (precomputed_) return;
  const AdaptersOff reference(model_);
  runner.forward_losses(batches, reference_);
}

TokenLoss PreferenceObjective::token_loss(size_t k) {
  TokenLoss loss;
  loss.weigh = [this, k](const float* policy, float* weights) { weigh(k, policy, weights); };
  return loss;
}

int64_t PreferenceObjective::responses_of(const SampleSource& source, const MicroBatch& b,
                                          int64_t row, int32_t* response) const {
  const int64_t seq = b.seq_len;
  if (!cp_.active()) {
    return row_responses(b.targets.data() + row * seq, b.positions.data() + row * seq, seq,
                         response);
  }
  // This rank holds two chunks of the row: the responses come from the whole
  // row, cut as its tokens were.
  const int64_t whole = source.seq_len(), sample = b.samples[static_cast<size_t>(row)];
  std::vector<int32_t> inputs(static_cast<size_t>(whole)), targets(inputs.size()),
      positions(inputs.size()), all(inputs.size());
  source.read_sample(sample, inputs.data(), targets.data());
  source.read_positions(sample, positions.data());
  const int64_t pairs = row_responses(targets.data(), positions.data(), whole, all.data());
  cp_.cut(all.data(), response, 1, whole);
  return pairs;
}

std::vector<std::vector<PairLoss>> PreferenceObjective::batch_pairs(const SampleSource& source,
                                                                    const MicroBatch& b,
                                                                    const float* policy,
                                                                    const float* reference,
                                                                    ReferenceLogps& table) {
  const int64_t seq = b.seq_len;
  // Per row: the policy's log-probabilities and token counts of its
  // responses, then the reference's when it comes from token losses.
  responses_.assign(static_cast<size_t>(b.rows), std::vector<int32_t>(static_cast<size_t>(seq)));
  std::vector<int64_t> pairs(static_cast<size_t>(b.rows));
  std::vector<double> sums;
  for (int64_t row = 0; row < b.rows; ++row) {
    int32_t* response = responses_[static_cast<size_t>(row)].data();
    const int64_t n = responses_of(source, b, row, response);
    pairs[static_cast<size_t>(row)] = n;
    const RowResponses mine = sum_responses(response, policy + row * seq, seq, n);
    sums.insert(sums.end(), mine.logps.begin(), mine.logps.end());
    sums.insert(sums.end(), mine.tokens.begin(), mine.tokens.end());
    if (reference != nullptr) {
      const RowResponses ref = sum_responses(response, reference + row * seq, seq, n);
      sums.insert(sums.end(), ref.logps.begin(), ref.logps.end());
    }
  }
  // Context parallelism: each rank summed its own tokens of every response.
  if (cp_.active() && !sums.empty()) {
    mesh_->cp().all_reduce(sums.data(), static_cast<int64_t>(sums.size()), CommDType::f64,
                           ReduceOp::sum);
  }
  std::vector<std::vector<PairLoss>> out(static_cast<size_t>(b.rows));
  size_t at = 0;
  for (int64_t row = 0; row < b.rows; ++row) {
    const auto responses = static_cast<size_t>(2 * pairs[static_cast<size_t>(row)]);
    const double* logps = sums.data() + at;
    const double* tokens = logps + responses;
    at += 2 * responses;
    const double* ref = nullptr;
    if (reference != nullptr) {
      ref = sums.data() + at;
      at += responses;
    } else {
      const std::span<double> stored = table.of(b.samples[static_cast<size_t>(row)]);
      MESHTRAIN_CHECK(stored.size() == responses,
                      "preference: {} reference log-probabilities for a row of {} responses",
                      stored.size(), responses);
      ref = stored.data();
    }
    for (size_t c = 0; c < responses; c += 2) {
      out[static_cast<size_t>(row)].push_back(dpo_pair_loss(
          settings_, {logps[c], logps[c + 1], ref[c], ref[c + 1],
                      static_cast<int64_t>(tokens[c]), static_cast<int64_t>(tokens[c + 1])}));
    }
  }
  return out;
}

void PreferenceObjective::weigh(size_t k, const float* policy_losses, float* weights) {
  const MicroBatch& b = batches_[k];
  const int64_t seq = b.seq_len;
  const std::vector<std::vector<PairLoss>> pairs = batch_pairs(
      source_, b, policy_losses, precomputed_ ? nullptr : reference_[k].data(), table_);
  const bool count = cp_.rank == 0;  // every cp rank has every pair: counted once
  for (int64_t row = 0; row < b.rows; ++row) {
    // d(pair loss) / d(token loss) of each response: −d(loss)/d(log π).
    std::vector<double> weight;
    for (const PairLoss& pair : pairs[static_cast<size_t>(row)]) {
      if (count) {
        loss_ += pair.loss;
        chosen_ += pair.chosen_reward;
        rejected_ += pair.rejected_reward;
        correct_ += pair.chosen_reward > pair.rejected_reward ? 1 : 0;
        pairs_ += 1;
      }
      weight.push_back(-pair.d_policy_chosen);
      weight.push_back(-pair.d_policy_rejected);
    }
    const std::vector<int32_t>& response = responses_[static_cast<size_t>(row)];
    float* w = weights + row * seq;
    for (int64_t t = 0; t < seq; ++t) {
      if (response[t] >= 0) w[t] = static_cast<float>(weight[static_cast<size_t>(response[t])]);
    }
  }
}

double PreferenceObjective::evaluate(const ValidationSet& val, StepRunner& runner,
                                     int64_t& units) {
  std::vector<MicroBatch> batches(static_cast<size_t>(val.num_micro_batches()));
  for (size_t k = 0; k < batches.size(); ++k) val.read(static_cast<int64_t>(k), batches[k]);
  std::vector<std::vector<float>> policy, reference;
  runner.forward_losses(batches, policy);
  if (!precomputed_) {
    const AdaptersOff off(model_);
    runner.forward_losses(batches, reference);
  }
  const bool head = model_.stage_layers().last;
  const bool count = cp_.rank == 0;  // every cp rank has every pair: counted once
  double loss = 0;
  std::vector<int32_t> response;
  for (size_t k = 0; k < batches.size(); ++k) {
    const MicroBatch& b = batches[k];
    if (!head) {  // the pairs only: this stage has no token losses
      response.resize(static_cast<size_t>(b.seq_len));
      for (int64_t row = 0; count && row < b.rows; ++row) {
        units += responses_of(val.source(), b, row, response.data());
      }
      continue;
    }
    for (const std::vector<PairLoss>& row :
         batch_pairs(val.source(), b, policy[k].data(),
                     precomputed_ ? nullptr : reference[k].data(), val_table_)) {
      for (const PairLoss& pair : row) {
        if (!count) continue;
        loss += pair.loss;
        ++units;
      }
    }
  }
  return loss;
}

double PreferenceObjective::finish(Communicator* stages, Communicator* dp, StepRecord& r) {
  double sums[4] = {chosen_, rejected_, correct_, pairs_};
  for (Communicator* group : {stages, dp}) {
    if (group != nullptr) group->all_reduce(sums, 4, CommDType::f64, ReduceOp::sum);
  }
  const double pairs = std::max(1.0, sums[3]);
  r.preference = true;
  r.reward_chosen = sums[0] / pairs;
  r.reward_rejected = sums[1] / pairs;
  r.reward_margin = (sums[0] - sums[1]) / pairs;
  r.reward_accuracy = sums[2] / pairs;
  batches_ = {};
  return loss_;
}

std::unique_ptr<StepObjective> make_step_objective(const TrainConfig& config, Model& model,
                                                   const SampleSource& source,
                                                   const ValidationSet* val,
                                                   const LoaderOptions& loader, DeviceMesh* mesh) {
  if (!config.data.preference()) return nullptr;
  return std::make_unique<PreferenceObjective>(config, model, source, val, loader, mesh);
}

}  // namespace meshtrain
