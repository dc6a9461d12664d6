#include "meshtrain/plan/finetune.h"

#include "meshtrain/plan/option_names.h"

namespace meshtrain::plan {
namespace {

constexpr OptionNames<FinetuneMethod, 4> kMethods{"--finetune", {"none", "full", "lora", "qlora"}};
constexpr OptionNames<LoraTargets, 2> kTargets{"--lora-targets", {"all", "qv"}};

}  // namespace

std::string_view finetune_name(FinetuneMethod m) { return kMethods.name(m); }
FinetuneMethod parse_finetune(std::string_view name) { return kMethods.parse(name); }
std::string_view lora_targets_name(LoraTargets t) { return kTargets.name(t); }
LoraTargets parse_lora_targets(std::string_view name) { return kTargets.parse(name); }

double lora_layer_params(const ModelConfig& c, const Finetune& f) {
  if (!f.adapters()) return 0;
  const double h = static_cast<double>(c.dim), ffn = static_cast<double>(c.hidden_dim);
  const double q = static_cast<double>(c.n_heads * c.head_dim());
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim());
  const double r = static_cast<double>(f.rank);
  // r (in + out) per adapted linear.
  if (f.targets == LoraTargets::qv) return r * ((h + q) + (h + kv));
  double sum = r * ((h + q) + 2 * (h + kv) + (q + h));  // q, k, v, o
  const double mlp = r * (h + ffn);
  sum += static_cast<double>(c.recipe().ff_in_factor() + 1) * mlp;  // gate, up, down (or fc1, fc2)
  return sum;
}

double frozen_weight_bytes(const Finetune& f, int64_t tp) {
  if (f.method != FinetuneMethod::qlora) return 2.0;
  return (tp > 1 ? kNf4SliceBits : kNf4DoubleQuantBits) / 8;
}

}  // namespace meshtrain::plan
