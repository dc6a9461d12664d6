// Direct preference optimisation (DPO; Rafailov et al. 2023) and IPO (Azar et
// al. 2023) as TRL's DPOTrainer defines them, on rows of preference pairs
// (data.format = "preference-jsonl", data/preference.h): each pair is two
// segments of one row, prompt + chosen then prompt + rejected, and a
// response's log-probability is the sum of its tokens' log-probabilities
// (minus the token losses the model computes).
//
// With z = (log πθ(c) − log πref(c)) − (log πθ(r) − log πref(r)):
//   sigmoid: loss = −(1 − ε) log σ(β z) − ε log σ(−β z)   (ε: label smoothing).
//            TRL >= 1.0's "sigmoid" is the ε = 0 form: its label_smoothing
//            feeds robust, exo_pair and aot only. The ε term is TRL 0.x's
//            sigmoid (cDPO).
//   ipo:     loss = (z' − 1 / (2β))², z' as z with each log-probability
//            divided by its response's token count, a count of 0 taken as 1
//            (TRL's IPO averages; its clamp(min=1)).
// TRL's batch loss is the mean of its pairs' losses.
// Rewards (TRL's metrics): chosen β (log πθ(c) − log πref(c)), rejected the
// same for r (summed log-probabilities for both losses); accuracy: chosen
// reward > rejected reward; margin: chosen − rejected.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace meshtrain {

enum class DpoLoss { sigmoid, ipo };

struct DpoSettings {
  double beta = 0.1;
  DpoLoss loss = DpoLoss::sigmoid;
  double label_smoothing = 0;  // sigmoid only
};

// One pair's summed response log-probabilities and token counts.
struct PairLogps {
  double policy_chosen = 0, policy_rejected = 0;
  double reference_chosen = 0, reference_rejected = 0;
  int64_t chosen_tokens = 0, rejected_tokens = 0;
};

// One pair's loss, rewards, and the loss's derivatives with respect to the
// policy's summed log-probabilities of the chosen and rejected responses.
struct PairLoss {
  double loss = 0;
  double chosen_reward = 0, rejected_reward = 0;
  double d_policy_chosen = 0, d_policy_rejected = 0;
};

PairLoss dpo_pair_loss(const DpoSettings& settings, const PairLogps& pair);

}  // namespace meshtrain
