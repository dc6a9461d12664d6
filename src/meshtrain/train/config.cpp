#include "meshtrain/train/config.h"

#include <glob.h>

#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>
#include <toml++/toml.h>

#include "meshtrain/backend/registry.h"
#include "meshtrain/parallel/context/context_parallel.h"
#include "meshtrain/plan/pipeline_split.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/trace_hook.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

enum class Kind { integer, number, boolean, string, string_list };

struct KeySpec {
  std::string_view section, name;
  Kind kind;
};

// Every accepted key; docs/config.md documents each (a test checks).
constexpr KeySpec kKeys[] = {
    {"model", "preset", Kind::string},        {"model", "family", Kind::string},
    {"model", "dim", Kind::integer},          {"model", "n_layers", Kind::integer},
    {"model", "n_heads", Kind::integer},      {"model", "n_kv_heads", Kind::integer},
    {"model", "hidden_dim", Kind::integer},   {"model", "vocab_size", Kind::integer},
    {"model", "max_seq_len", Kind::integer},  {"model", "norm_eps", Kind::number},
    {"model", "rope_theta", Kind::number},    {"model", "tie_embeddings", Kind::boolean},
    {"model", "init_std", Kind::number},      {"model", "head_dim", Kind::integer},
    {"model", "qkv_bias", Kind::boolean},     {"model", "qk_norm", Kind::string},
    {"model", "sliding_window", Kind::integer},

    {"train", "precision", Kind::string},     {"train", "seed", Kind::integer},
    {"train", "steps", Kind::integer},        {"train", "batch_size", Kind::integer},
    {"train", "batch_tokens", Kind::integer},
    {"train", "micro_batch_size", Kind::integer}, {"train", "seq_len", Kind::integer},
    {"train", "device", Kind::string},       {"train", "threads", Kind::integer},      {"train", "grad_clip", Kind::number},
    {"train", "eval_interval", Kind::integer}, {"train", "eval_batches", Kind::integer},
    {"train", "log_interval", Kind::integer}, {"train", "peak_flops", Kind::number},
    {"train", "checkpoint_interval", Kind::integer}, {"train", "out_dir", Kind::string},
    {"train", "recompute", Kind::string},     {"train", "recompute_layers", Kind::integer},
    {"train", "loss_scale_init", Kind::number},
    {"train", "loss_scale_growth_interval", Kind::integer},
    {"train", "loss_scale_min", Kind::number},
    {"train", "straggler_interval", Kind::integer},
    {"train", "straggler_threshold", Kind::number},
    {"train", "memory_check", Kind::string},
    {"train", "trace_steps", Kind::string},
    {"train", "init_from", Kind::string},

    {"optim", "lr", Kind::number},            {"optim", "min_lr", Kind::number},
    {"optim", "warmup_steps", Kind::integer}, {"optim", "decay", Kind::string},
    {"optim", "beta1", Kind::number},         {"optim", "beta2", Kind::number},
    {"optim", "eps", Kind::number},           {"optim", "weight_decay", Kind::number},

    {"data", "train", Kind::string_list},     {"data", "val", Kind::string_list},
    {"data", "tokenizer", Kind::string},      {"data", "gpt2_ranks", Kind::string},
    {"data", "format", Kind::string},         {"data", "sft_pack", Kind::boolean},
    {"data", "sft_overflow", Kind::string},

    {"parallel", "tp", Kind::integer},        {"parallel", "pp", Kind::integer},
    {"parallel", "ep", Kind::integer},
    {"parallel", "cp", Kind::integer},        {"parallel", "cp_comm", Kind::string},
    {"parallel", "sequence_parallel", Kind::boolean},
    {"parallel", "bucket_mb", Kind::number},  {"parallel", "overlap", Kind::boolean},
    {"parallel", "zero", Kind::integer},      {"parallel", "prefetch", Kind::boolean},
    {"parallel", "reshard_after_forward", Kind::boolean},
    {"parallel", "max_inflight_reduces", Kind::integer},
    {"parallel", "offload", Kind::string},    {"parallel", "offload_dir", Kind::string},
    {"parallel", "offload_budget_mb", Kind::number},
    {"parallel", "schedule", Kind::string},   {"parallel", "virtual_stages", Kind::integer},
    {"parallel", "pp_split", Kind::string},

    {"ckpt", "buffer_mb", Kind::number},      {"ckpt", "async", Kind::boolean},
    {"ckpt", "keep_last", Kind::integer},

    {"guard", "enabled", Kind::boolean},      {"guard", "max_skips", Kind::integer},
    {"guard", "window", Kind::integer},       {"guard", "min_steps", Kind::integer},
    {"guard", "loss_z", Kind::number},        {"guard", "grad_z", Kind::number},
    {"guard", "policy", Kind::string},        {"guard", "rollback_skip_batches", Kind::integer},
    {"guard", "max_rollbacks", Kind::integer},
    {"lora", "rank", Kind::integer},          {"lora", "alpha", Kind::number},
    {"lora", "dropout", Kind::number},        {"lora", "targets", Kind::string_list},
    {"lora", "quantize_base", Kind::string},
    {"moe", "experts", Kind::integer},        {"moe", "top_k", Kind::integer},
    {"moe", "hidden_dim", Kind::integer},     {"moe", "score", Kind::string},
    {"moe", "renormalize", Kind::boolean},    {"moe", "scaling", Kind::number},
    {"moe", "n_groups", Kind::integer},       {"moe", "topk_groups", Kind::integer},
    {"moe", "shared_hidden", Kind::integer},  {"moe", "shared_gate", Kind::boolean},
    {"moe", "first_dense", Kind::integer},    {"moe", "every", Kind::integer},
    {"moe", "aux_loss", Kind::number},        {"moe", "z_loss", Kind::number},
    {"moe", "aux_scope", Kind::string},
    {"moe", "capacity_factor", Kind::number}, {"moe", "bias_update_rate", Kind::number},
    {"dpo", "beta", Kind::number},            {"dpo", "loss", Kind::string},
    {"dpo", "label_smoothing", Kind::number}, {"dpo", "precompute_reference", Kind::boolean},
    {"comm", "timeout_s", Kind::number},      {"comm", "long_timeout_s", Kind::number},
    {"comm", "flight_records", Kind::integer}, {"comm", "backend", Kind::string},
};

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::integer: return "an integer";
    case Kind::number: return "a number";
    case Kind::boolean: return "a boolean (true or false)";
    case Kind::string: return "a string";
    case Kind::string_list: return "a string or an array of strings";
  }
  return "?";
}

std::string full_name(const KeySpec& spec) {
  return fmt::format("{}.{}", spec.section, spec.name);
}

const KeySpec* find_key(std::string_view section, std::string_view name) {
  for (const KeySpec& spec : kKeys) {
    if (spec.section == section && spec.name == name) return &spec;
  }
  return nullptr;
}

bool known_section(std::string_view section) {
  for (const KeySpec& spec : kKeys) {
    if (spec.section == section) return true;
  }
  return false;
}

// What the user wrote, for "got ..." in messages.
std::string describe(const toml::node& node) {
  std::ostringstream os;
  if (node.is_string()) {
    os << '"' << node.as_string()->get() << '"';
  } else if (node.is_table()) {
    os << "a table";
  } else if (node.is_array()) {
    os << "an array";
  } else {
    node.visit([&](auto&& v) { os << v; });
  }
  return os.str();
}

bool kind_matches(Kind kind, const toml::node& node) {
  switch (kind) {
    case Kind::integer: return node.is_integer();
    case Kind::number: return node.is_integer() || node.is_floating_point();
    case Kind::boolean: return node.is_boolean();
    case Kind::string: return node.is_string();
    case Kind::string_list:
      return node.is_string() || (node.is_array() && node.as_array()->is_homogeneous<std::string>());
  }
  return false;
}

// Parses a command-line override value per the key's type.
void apply_override(toml::table& root, const std::string& key, const std::string& value) {
  auto dot = key.find('.');
  std::string_view section = dot == std::string::npos ? std::string_view{} : std::string_view(key).substr(0, dot);
  std::string_view name = dot == std::string::npos ? std::string_view(key) : std::string_view(key).substr(dot + 1);
  const KeySpec* spec = find_key(section, name);
  MESHTRAIN_CHECK(spec != nullptr, "config: unknown key '{}'", key);
  auto bad = [&]() {
    fail("config: {} must be {}, got \"{}\"", key, kind_name(spec->kind), value);
  };
  if (!root.contains(section)) root.insert(section, toml::table{});
  toml::table* table = root[section].as_table();
  MESHTRAIN_CHECK(table != nullptr, "config: [{}] must be a table", section);
  switch (spec->kind) {
    case Kind::integer: {
      int64_t v = 0;
      auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (ec != std::errc() || ptr != value.data() + value.size()) bad();
      table->insert_or_assign(name, v);
      break;
    }
    case Kind::number: {
      double v = 0;
      auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (ec != std::errc() || ptr != value.data() + value.size()) bad();
      table->insert_or_assign(name, v);
      break;
    }
    case Kind::boolean:
      if (value != "true" && value != "false") bad();
      table->insert_or_assign(name, value == "true");
      break;
    case Kind::string:
    case Kind::string_list:
      table->insert_or_assign(name, value);
      break;
  }
}

// Typed access to one validated table; missing keys keep the default.
class Section {
 public:
  Section(const toml::table& root, std::string_view name) : name_(name) {
    if (const toml::node* node = root.get(name)) table_ = node->as_table();
  }
  const toml::node* get(std::string_view key) const {
    return table_ == nullptr ? nullptr : table_->get(key);
  }
  bool has(std::string_view key) const { return get(key) != nullptr; }
  void read(std::string_view key, int64_t& out) const {
    if (auto* n = get(key)) out = n->as_integer()->get();
  }
  void read(std::string_view key, int& out) const {
    if (auto* n = get(key)) {
      int64_t v = n->as_integer()->get();
      MESHTRAIN_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(),
                      "config: {}.{} is out of range, got {}", name_, key, v);
      out = static_cast<int>(v);
    }
  }
  void read(std::string_view key, double& out) const {
    if (auto* n = get(key)) out = n->is_integer() ? static_cast<double>(n->as_integer()->get())
                                                  : n->as_floating_point()->get();
  }
  void read(std::string_view key, float& out) const {
    double v = out;
    read(key, v);
    out = static_cast<float>(v);
  }
  void read(std::string_view key, bool& out) const {
    if (auto* n = get(key)) out = n->as_boolean()->get();
  }
  void read(std::string_view key, std::string& out) const {
    if (auto* n = get(key)) out = n->as_string()->get();
  }
  void read(std::string_view key, std::vector<std::string>& out) const {
    if (auto* n = get(key)) {
      out.clear();
      if (n->is_string()) {
        out.push_back(n->as_string()->get());
      } else {
        for (const toml::node& item : *n->as_array()) out.push_back(item.as_string()->get());
      }
    }
  }

 private:
  std::string_view name_;
  const toml::table* table_ = nullptr;
};

// Rejects unknown sections and keys and values of the wrong type.
void check_keys_and_types(const toml::table& root) {
  for (auto&& [section, node] : root) {
    const toml::table* table = node.as_table();
    MESHTRAIN_CHECK(table != nullptr,
                    "config: unknown key '{}' (keys belong in [model], [train], [optim] or [data])",
                    section.str());
    MESHTRAIN_CHECK(known_section(section.str()), "config: unknown section '{}'", section.str());
    for (auto&& [key, value] : *table) {
      const KeySpec* spec = find_key(section.str(), key.str());
      MESHTRAIN_CHECK(spec != nullptr, "config: unknown key '{}.{}'", section.str(), key.str());
      MESHTRAIN_CHECK(kind_matches(spec->kind, value), "config: {} must be {}, got {}",
                      full_name(*spec), kind_name(spec->kind), describe(value));
    }
  }
}

template <typename T>
void check_min(std::string_view key, T value, T min) {
  MESHTRAIN_CHECK(value >= min, "config: {} must be >= {}, got {}", key, min, value);
}

// validate = false: train.init_from supplies the model (checked there).
ModelConfig read_model(const Section& s, std::string& preset, bool validate) {
  ModelConfig m;
  s.read("preset", preset);
  if (!preset.empty()) {
    bool known = false;
    for (const std::string& name : model_preset_names()) known = known || name == preset;
    MESHTRAIN_CHECK(known, "config: model.preset must be one of {}, got \"{}\"",
                    fmt::join(model_preset_names(), ", "), preset);
    m = model_preset(preset);
  }
  std::string family(family_name(m.family));
  s.read("family", family);
  m.family = parse_family(family, "config: model.family");
  s.read("dim", m.dim);
  s.read("n_layers", m.n_layers);
  s.read("n_heads", m.n_heads);
  s.read("n_kv_heads", m.n_kv_heads);
  // Without a preset, n_kv_heads defaults to n_heads (no grouping).
  if (preset.empty() && !s.has("n_kv_heads")) m.n_kv_heads = m.n_heads;
  s.read("hidden_dim", m.hidden_dim);
  s.read("vocab_size", m.vocab_size);
  s.read("max_seq_len", m.max_seq_len);
  s.read("norm_eps", m.norm_eps);
  s.read("rope_theta", m.rope_theta);
  s.read("tie_embeddings", m.tie_embeddings);
  s.read("init_std", m.init_std);
  s.read("head_dim", m.head_width);
  s.read("qkv_bias", m.qkv_bias);
  s.read("sliding_window", m.sliding_window);
  std::string qk_norm(qk_norm_name(m.qk_norm));
  s.read("qk_norm", qk_norm);
  m.qk_norm = parse_qk_norm(qk_norm);
  if (!validate) return m;
  try {
    m.validate();
  } catch (const Error& e) {
    fail("config: {}", e.what());
  }
  return m;
}

TrainSettings read_train(const Section& s, const ModelConfig& model) {
  TrainSettings t;
  std::string precision(precision_name(t.precision));
  s.read("precision", precision);
  MESHTRAIN_CHECK(precision == "fp32" || precision == "bf16" || precision == "fp16",
                  "config: train.precision must be \"fp32\", \"bf16\" or \"fp16\", got \"{}\"",
                  precision);
  t.precision = parse_precision(precision);
  LossScaleSettings& ls = t.loss_scale;
  s.read("loss_scale_init", ls.init);
  s.read("loss_scale_growth_interval", ls.growth_interval);
  s.read("loss_scale_min", ls.min);
  MESHTRAIN_CHECK(std::isfinite(ls.min) && ls.min > 0,
                  "config: train.loss_scale_min must be a positive number, got {}", ls.min);
  MESHTRAIN_CHECK(std::isfinite(ls.init) && ls.init >= ls.min,
                  "config: train.loss_scale_init ({}) must be a finite number >= "
                  "train.loss_scale_min ({})",
                  ls.init, ls.min);
  check_min<int64_t>("train.loss_scale_growth_interval", ls.growth_interval, 1);
  const LossScaleSettings defaults;
  if (t.precision != Precision::fp16) {
    // Only fp16 scales the loss; a setting elsewhere would silently do nothing.
    for (const auto& [key, set] :
         {std::pair{"loss_scale_init", ls.init != defaults.init},
          std::pair{"loss_scale_growth_interval", ls.growth_interval != defaults.growth_interval},
          std::pair{"loss_scale_min", ls.min != defaults.min}}) {
      MESHTRAIN_CHECK(!set, "config: train.{} applies to train.precision = \"fp16\" only (this "
                            "run is \"{}\")",
                      key, precision);
    }
  }
  int64_t seed = static_cast<int64_t>(t.seed);
  s.read("seed", seed);
  check_min<int64_t>("train.seed", seed, 0);
  t.seed = static_cast<uint64_t>(seed);
  s.read("steps", t.steps);
  s.read("batch_size", t.batch_size);
  s.read("batch_tokens", t.batch_tokens);
  s.read("micro_batch_size", t.micro_batch_size);
  s.read("seq_len", t.seq_len);
  s.read("device", t.device);
  s.read("threads", t.threads);
  s.read("grad_clip", t.grad_clip);
  s.read("eval_interval", t.eval_interval);
  s.read("eval_batches", t.eval_batches);
  s.read("log_interval", t.log_interval);
  s.read("peak_flops", t.peak_flops);
  s.read("checkpoint_interval", t.checkpoint_interval);
  s.read("out_dir", t.out_dir);
  s.read("init_from", t.init_from);
  std::string recompute(recompute_name(t.recompute));
  s.read("recompute", recompute);
  MESHTRAIN_CHECK(recompute == "none" || recompute == "selective" || recompute == "full",
                  "config: train.recompute must be \"none\", \"selective\" or \"full\", got "
                  "\"{}\"",
                  recompute);
  t.recompute = parse_recompute(recompute);
  s.read("recompute_layers", t.recompute_layers);
  s.read("memory_check", t.memory_check);
  s.read("trace_steps", t.trace_steps);
  if (!t.trace_steps.empty()) parse_trace_steps(t.trace_steps);
  MESHTRAIN_CHECK(t.memory_check == "error" || t.memory_check == "warn" || t.memory_check == "off",
                  "config: train.memory_check must be \"error\", \"warn\" or \"off\", got \"{}\"",
                  t.memory_check);

  check_min<int64_t>("train.steps", t.steps, 1);
  check_min<int64_t>("train.seq_len", t.seq_len, 1);
  check_min<int64_t>("train.batch_tokens", t.batch_tokens, 0);
  if (t.batch_tokens > 0) {
    MESHTRAIN_CHECK(t.batch_tokens % t.seq_len == 0,
                    "config: train.batch_tokens ({}) must be a multiple of train.seq_len ({})",
                    t.batch_tokens, t.seq_len);
    const int64_t sequences = t.batch_tokens / t.seq_len;
    MESHTRAIN_CHECK(!s.has("batch_size") || t.batch_size == sequences,
                    "config: train.batch_size ({}) contradicts train.batch_tokens ({} = {} "
                    "sequences of {}); give one of them",
                    t.batch_size, t.batch_tokens, sequences, t.seq_len);
    t.batch_size = sequences;
  }
  check_min<int64_t>("train.batch_size", t.batch_size, 1);
  check_min<int64_t>("train.micro_batch_size", t.micro_batch_size, 0);
  if (t.micro_batch_size == 0) t.micro_batch_size = t.batch_size;
  MESHTRAIN_CHECK(t.batch_size % t.micro_batch_size == 0,
                  "config: train.batch_size ({}) must be a multiple of train.micro_batch_size ({})",
                  t.batch_size, t.micro_batch_size);
  MESHTRAIN_CHECK(t.seq_len <= model.max_seq_len,
                  "config: train.seq_len ({}) must be <= model.max_seq_len ({})", t.seq_len,
                  model.max_seq_len);
  backend_kind(t.device);  // names train.device when it is not a backend of this build
  check_min("train.threads", t.threads, 0);
  MESHTRAIN_CHECK(std::isfinite(t.grad_clip) && t.grad_clip >= 0,
                  "config: train.grad_clip must be >= 0 (0 = off), got {}", t.grad_clip);
  check_min<int64_t>("train.eval_interval", t.eval_interval, 0);
  check_min<int64_t>("train.eval_batches", t.eval_batches, 1);
  check_min<int64_t>("train.log_interval", t.log_interval, 1);
  MESHTRAIN_CHECK(std::isfinite(t.peak_flops) && t.peak_flops >= 0,
                  "config: train.peak_flops must be >= 0 (0 = measure), got {}", t.peak_flops);
  check_min<int64_t>("train.checkpoint_interval", t.checkpoint_interval, -1);
  MESHTRAIN_CHECK(!t.out_dir.empty(), "config: train.out_dir must not be empty");
  check_min<int64_t>("train.recompute_layers", t.recompute_layers, 0);
  s.read("straggler_interval", t.straggler_interval);
  s.read("straggler_threshold", t.straggler_threshold);
  check_min<int64_t>("train.straggler_interval", t.straggler_interval, 0);
  MESHTRAIN_CHECK(std::isfinite(t.straggler_threshold) && t.straggler_threshold > 0,
                  "config: train.straggler_threshold must be > 0, got {}", t.straggler_threshold);
  MESHTRAIN_CHECK(t.recompute_layers == 0 || t.recompute == Recompute::full,
                  "config: train.recompute_layers ({}) needs train.recompute = \"full\"",
                  t.recompute_layers);
  return t;
}

OptimSettings read_optim(const Section& s) {
  OptimSettings o;
  s.read("lr", o.lr);
  s.read("min_lr", o.min_lr);
  s.read("warmup_steps", o.warmup_steps);
  std::string decay = "cosine";
  s.read("decay", decay);
  MESHTRAIN_CHECK(decay == "cosine" || decay == "constant",
                  "config: optim.decay must be \"cosine\" or \"constant\", got \"{}\"", decay);
  o.decay = parse_lr_decay(decay);
  s.read("beta1", o.adamw.beta1);
  s.read("beta2", o.adamw.beta2);
  s.read("eps", o.adamw.eps);
  s.read("weight_decay", o.adamw.weight_decay);

  MESHTRAIN_CHECK(std::isfinite(o.lr) && o.lr > 0, "config: optim.lr must be > 0, got {}", o.lr);
  MESHTRAIN_CHECK(std::isfinite(o.min_lr) && o.min_lr >= 0 && o.min_lr <= o.lr,
                  "config: optim.min_lr must be in [0, optim.lr = {}], got {}", o.lr, o.min_lr);
  check_min<int64_t>("optim.warmup_steps", o.warmup_steps, 0);
  for (auto [key, value] : {std::pair{"optim.beta1", o.adamw.beta1}, {"optim.beta2", o.adamw.beta2}}) {
    MESHTRAIN_CHECK(value >= 0 && value < 1, "config: {} must be in [0, 1), got {}", key, value);
  }
  MESHTRAIN_CHECK(std::isfinite(o.adamw.eps) && o.adamw.eps > 0,
                  "config: optim.eps must be > 0, got {}", o.adamw.eps);
  MESHTRAIN_CHECK(std::isfinite(o.adamw.weight_decay) && o.adamw.weight_decay >= 0,
                  "config: optim.weight_decay must be >= 0, got {}", o.adamw.weight_decay);
  return o;
}

DataSettings read_data(const Section& s) {
  DataSettings d;
  s.read("train", d.train);
  s.read("val", d.val);
  MESHTRAIN_CHECK(!d.train.empty(), "config: data.train is required (a token file, glob or list)");
  for (const std::string& path : d.train) {
    MESHTRAIN_CHECK(!path.empty(), "config: data.train must not contain an empty path");
  }
  for (const std::string& path : d.val) {
    MESHTRAIN_CHECK(!path.empty(), "config: data.val must not contain an empty path");
  }
  s.read("tokenizer", d.tokenizer);
  // "gpt2", "bytes", or a tokenizer file or folder: make_tokenizer names a path
  // that holds none when the run starts (a saved config's path may be gone:
  // checkpoints carry the files).
  MESHTRAIN_CHECK(!d.tokenizer.empty(), "config: data.tokenizer must not be empty (\"gpt2\", "
                  "\"bytes\", a tokenizer.json, a tokenizer.model or a folder with one)");
  s.read("gpt2_ranks", d.gpt2_ranks);
  MESHTRAIN_CHECK(!d.gpt2_ranks.empty(), "config: data.gpt2_ranks must not be empty");
  s.read("format", d.format);
  MESHTRAIN_CHECK(d.format == "tokens" || d.records(),
                  "config: data.format must be \"tokens\", \"sft-jsonl\", \"chat-jsonl\" or "
                  "\"preference-jsonl\", got \"{}\"", d.format);
  s.read("sft_pack", d.sft_pack);
  s.read("sft_overflow", d.sft_overflow);
  MESHTRAIN_CHECK(d.sft_overflow == "truncate" || d.sft_overflow == "refuse",
                  "config: data.sft_overflow must be \"truncate\" or \"refuse\", got \"{}\"",
                  d.sft_overflow);
  // A setting that would silently do nothing.
  const DataSettings defaults;
  for (const auto& [key, set] : {std::pair{"sft_pack", d.sft_pack != defaults.sft_pack},
                                 std::pair{"sft_overflow", d.sft_overflow != defaults.sft_overflow}}) {
    MESHTRAIN_CHECK(d.records() || !set,
                    "config: data.{} applies to data.format = \"sft-jsonl\", \"chat-jsonl\" or "
                    "\"preference-jsonl\" only (this run reads \"{}\")",
                    key, d.format);
  }
  return d;
}

}  // namespace

namespace {

bool pp_split_is_rule(const std::string& split) {
  return split.empty() || split == "uniform" || split == "auto";
}

// An explicit parallel.pp_split list ("7,1").
std::vector<int64_t> parse_pp_split(const std::string& text) {
  std::vector<int64_t> split;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    int64_t n = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), n);
    MESHTRAIN_CHECK(ec == std::errc() && ptr == item.data() + item.size() && n >= 1,
                    "config: parallel.pp_split must be \"auto\", \"uniform\" or layer counts >= 1 "
                    "separated by commas (\"3,2\"), got \"{}\"",
                    text);
    split.push_back(n);
    begin = end + 1;
  }
  return split;
}

}  // namespace

std::vector<int64_t> pp_split_layers(const TrainConfig& config) {
  const ParallelSettings& p = config.parallel;
  if (!pp_split_is_rule(p.pp_split)) return parse_pp_split(p.pp_split);
  const int64_t chunks = static_cast<int64_t>(p.pp) * p.virtual_stages;
  if (p.pp_split != "auto" || p.pp == 1 || config.model.n_layers < chunks) return {};
  // The CPU engine's time is close to its FLOPs (one GEMM rate; the embedding
  // lookup and the loss's softmax are a small streaming share): cost the
  // micro-batch on a FLOP-counting device. Activations are stored, not recomputed.
  plan::ComputeShape shape;
  shape.seq = config.train.seq_len;
  shape.micro_batch = std::max<int64_t>(1, config.train.micro_batch_size);
  shape.tp = p.tp;
  shape.recompute = plan::Recompute::none;
  return plan::balanced_pipeline_split(
      plan::layer_costs(config.model, plan::flop_counting_gpu(), shape), config.model.n_layers,
      p.pp, p.virtual_stages);
}

namespace {

CkptSettings read_ckpt(const Section& s) {
  CkptSettings c;
  s.read("buffer_mb", c.buffer_mb);
  s.read("async", c.async);
  s.read("keep_last", c.keep_last);
  MESHTRAIN_CHECK(std::isfinite(c.buffer_mb) && c.buffer_mb >= 1,
                  "config: ckpt.buffer_mb must be >= 1, got {}", c.buffer_mb);
  check_min<int64_t>("ckpt.keep_last", c.keep_last, 0);
  return c;
}

CommSettings read_comm(const Section& s) {
  CommSettings c;
  s.read("timeout_s", c.timeout_s);
  s.read("long_timeout_s", c.long_timeout_s);
  s.read("flight_records", c.flight_records);
  s.read("backend", c.backend);
  MESHTRAIN_CHECK(c.backend == "auto" || c.backend == "mpi" || c.backend == "nccl",
                  "config: comm.backend must be \"auto\", \"mpi\" or \"nccl\", got \"{}\"",
                  c.backend);
  MESHTRAIN_CHECK(std::isfinite(c.timeout_s) && c.timeout_s >= 0,
                  "config: comm.timeout_s must be >= 0 (0 = no deadline), got {}", c.timeout_s);
  MESHTRAIN_CHECK(std::isfinite(c.long_timeout_s) && c.long_timeout_s >= 0,
                  "config: comm.long_timeout_s must be >= 0 (0 = no deadline), got {}",
                  c.long_timeout_s);
  check_min<int64_t>("comm.flight_records", c.flight_records, 0);
  MESHTRAIN_CHECK(c.flight_records > 0 || (c.timeout_s == 0 && c.long_timeout_s == 0),
                  "config: comm.flight_records = 0 turns the flight recorder off, and the watchdog "
                  "reads it: set comm.timeout_s and comm.long_timeout_s to 0 too");
  return c;
}

ParallelSettings read_parallel(const Section& s) {
  ParallelSettings p;
  s.read("tp", p.tp);
  s.read("sequence_parallel", p.sequence_parallel);
  s.read("pp", p.pp);
  s.read("ep", p.ep);
  s.read("cp", p.cp);
  s.read("cp_comm", p.cp_comm);
  s.read("bucket_mb", p.bucket_mb);
  s.read("overlap", p.overlap);
  check_min("parallel.tp", p.tp, 1);
  check_min("parallel.pp", p.pp, 1);
  check_min("parallel.ep", p.ep, 1);
  check_min("parallel.cp", p.cp, 1);
  parse_cp_comm(p.cp_comm);  // validates the name
  MESHTRAIN_CHECK(std::isfinite(p.bucket_mb) && p.bucket_mb > 0,
                  "config: parallel.bucket_mb must be > 0, got {}", p.bucket_mb);
  s.read("zero", p.zero);
  s.read("prefetch", p.prefetch);
  s.read("reshard_after_forward", p.reshard_after_forward);
  s.read("max_inflight_reduces", p.max_inflight_reduces);
  check_min("parallel.max_inflight_reduces", p.max_inflight_reduces, int64_t{1});
  s.read("offload", p.offload);
  s.read("offload_dir", p.offload_dir);
  s.read("offload_budget_mb", p.offload_budget_mb);
  MESHTRAIN_CHECK(p.zero >= 0 && p.zero <= 3, "config: parallel.zero must be 0, 1, 2 or 3, got {}",
                  p.zero);
  MESHTRAIN_CHECK(p.offload == "none" || p.offload == "cpu" || p.offload == "disk",
                  "config: parallel.offload must be \"none\", \"cpu\" or \"disk\", got \"{}\"",
                  p.offload);
  MESHTRAIN_CHECK(p.offload == "none" || p.zero >= 1,
                  "config: parallel.offload = \"{}\" moves ZeRO's sharded optimizer state: it "
                  "needs parallel.zero >= 1",
                  p.offload);
  MESHTRAIN_CHECK(std::isfinite(p.offload_budget_mb) && p.offload_budget_mb >= 0,
                  "config: parallel.offload_budget_mb must be >= 0, got {}", p.offload_budget_mb);
  s.read("schedule", p.schedule);
  s.read("virtual_stages", p.virtual_stages);
  s.read("pp_split", p.pp_split);
  MESHTRAIN_CHECK(p.schedule == "gpipe" || p.schedule == "1f1b" || p.schedule == "interleaved",
                  "config: parallel.schedule must be \"gpipe\", \"1f1b\" or \"interleaved\", got "
                  "\"{}\"",
                  p.schedule);
  check_min("parallel.virtual_stages", p.virtual_stages, 1);
  if (!pp_split_is_rule(p.pp_split)) parse_pp_split(p.pp_split);  // validates the list
  return p;
}

PreferenceSettings read_dpo(const Section& s, const TrainConfig& c) {
  PreferenceSettings p;
  p.precompute_reference = !c.model.lora.enabled();
  for (const char* key : {"beta", "loss", "label_smoothing", "precompute_reference"}) {
    MESHTRAIN_CHECK(c.data.preference() || !s.has(key),
                    "config: dpo.{} applies to data.format = \"preference-jsonl\" only (this run "
                    "reads \"{}\")",
                    key, c.data.format);
  }
  s.read("beta", p.loss.beta);
  MESHTRAIN_CHECK(std::isfinite(p.loss.beta) && p.loss.beta > 0,
                  "config: dpo.beta must be > 0, got {}", p.loss.beta);
  std::string loss = "sigmoid";
  s.read("loss", loss);
  MESHTRAIN_CHECK(loss == "sigmoid" || loss == "ipo",
                  "config: dpo.loss must be \"sigmoid\" or \"ipo\", got \"{}\"", loss);
  p.loss.loss = loss == "ipo" ? DpoLoss::ipo : DpoLoss::sigmoid;
  s.read("label_smoothing", p.loss.label_smoothing);
  MESHTRAIN_CHECK(p.loss.label_smoothing >= 0 && p.loss.label_smoothing < 0.5,
                  "config: dpo.label_smoothing must be in [0, 0.5), got {}",
                  p.loss.label_smoothing);
  MESHTRAIN_CHECK(p.loss.label_smoothing == 0 || p.loss.loss == DpoLoss::sigmoid,
                  "config: dpo.label_smoothing applies to dpo.loss = \"sigmoid\" only");
  s.read("precompute_reference", p.precompute_reference);
  MESHTRAIN_CHECK(p.precompute_reference || c.model.lora.enabled(),
                  "config: dpo.precompute_reference = false needs LoRA (lora.rank > 0: the "
                  "reference is the model with its adapters off); full fine-tuning keeps no "
                  "frozen copy of the model, so its reference is precomputed");
  return p;
}

GuardSettings read_guard(const Section& s) {
  GuardSettings g;
  s.read("enabled", g.enabled);
  s.read("max_skips", g.max_skips);
  s.read("window", g.window);
  s.read("min_steps", g.min_steps);
  s.read("loss_z", g.loss_z);
  s.read("grad_z", g.grad_z);
  std::string policy = "skip";
  s.read("policy", policy);
  MESHTRAIN_CHECK(policy == "skip" || policy == "rollback",
                  "config: guard.policy must be \"skip\" or \"rollback\", got \"{}\"", policy);
  g.policy = policy == "skip" ? GuardPolicy::skip : GuardPolicy::rollback;
  s.read("rollback_skip_batches", g.rollback_skip_batches);
  s.read("max_rollbacks", g.max_rollbacks);
  check_min<int64_t>("guard.max_skips", g.max_skips, 1);
  check_min<int64_t>("guard.window", g.window, 2);
  check_min<int64_t>("guard.min_steps", g.min_steps, 2);
  MESHTRAIN_CHECK(g.min_steps <= g.window,
                  "config: guard.min_steps ({}) must be <= guard.window ({})", g.min_steps,
                  g.window);
  for (auto [key, value] : {std::pair{"guard.loss_z", g.loss_z}, {"guard.grad_z", g.grad_z}}) {
    MESHTRAIN_CHECK(std::isfinite(value) && value >= 0, "config: {} must be >= 0 (0 = off), got {}",
                    key, value);
  }
  check_min<int64_t>("guard.rollback_skip_batches", g.rollback_skip_batches, 0);
  check_min<int64_t>("guard.max_rollbacks", g.max_rollbacks, 0);
  return g;
}

// [lora] into the model config (its registry holds the adapters).
void read_lora(const Section& s, ModelConfig& m) {
  LoraConfig& l = m.lora;
  s.read("rank", l.rank);
  s.read("alpha", l.alpha);
  s.read("dropout", l.dropout);
  s.read("targets", l.targets);
  std::string quant(base_quant_name(l.quantize_base));
  s.read("quantize_base", quant);
  try {
    l.quantize_base = parse_base_quant(quant);
  } catch (const Error& e) {
    fail("config: {}", e.what());
  }
  check_min<int64_t>("lora.rank", l.rank, 0);
  if (l.rank == 0) {
    MESHTRAIN_CHECK(l.quantize_base == BaseQuant::none,
                    "config: lora.quantize_base = \"{}\" quantises the frozen base of a LoRA "
                    "run; it needs lora.rank >= 1",
                    quant);
    MESHTRAIN_CHECK(!s.has("alpha") && !s.has("dropout") && !s.has("targets"),
                    "config: [lora] needs lora.rank >= 1 (0 or no [lora] section: no LoRA)");
    return;
  }
  try {
    m.validate();
  } catch (const Error& e) {
    fail("config: {}", e.what());
  }
  l.targets = lora_targets(l, m.family);  // explicit, as saved
}

// [moe] into the model config (docs/moe.md); validated with the model.
void read_moe(const Section& s, ModelConfig& m) {
  MoeConfig& e = m.moe;
  s.read("experts", e.experts);
  s.read("top_k", e.top_k);
  s.read("hidden_dim", e.hidden_dim);
  std::string score(router_score_name(e.score));
  s.read("score", score);
  e.score = parse_router_score(score);
  s.read("renormalize", e.renormalize);
  s.read("scaling", e.scaling);
  s.read("n_groups", e.n_groups);
  s.read("topk_groups", e.topk_groups);
  s.read("shared_hidden", e.shared_hidden);
  s.read("shared_gate", e.shared_gate);
  s.read("first_dense", e.first_dense);
  s.read("every", e.every);
  s.read("aux_loss", e.aux_loss);
  s.read("z_loss", e.z_loss);
  std::string scope = e.aux_per_step ? "step" : "micro_batch";
  s.read("aux_scope", scope);
  MESHTRAIN_CHECK(scope == "micro_batch" || scope == "step",
                  "config: moe.aux_scope must be \"micro_batch\" or \"step\", got \"{}\"", scope);
  e.aux_per_step = scope == "step";
  s.read("capacity_factor", e.capacity_factor);
  s.read("bias_update_rate", e.bias_update_rate);
  try {
    m.validate();
  } catch (const Error& err) {
    fail("config: {}", err.what());
  }
}

// resolve_init_from: a config file's train.init_from gives the model
// (apply_init_from_model); a checkpoint's saved config (config_from_json)
// already holds that model in full and does not read the directory again.
TrainConfig from_table(const toml::table& root, bool resolve_init_from) {
  check_keys_and_types(root);
  TrainConfig c;
  std::string init_from;
  Section(root, "train").read("init_from", init_from);
  const bool from_dir = resolve_init_from && !init_from.empty();
  c.model = read_model(Section(root, "model"), c.model_preset, !from_dir);
  if (const toml::node* model = root.get("model"); model != nullptr && model->as_table()) {
    for (const auto& [key, value] : *model->as_table()) c.model_keys.emplace_back(key.str());
  }
  if (from_dir) apply_init_from_model(c, init_from);
  c.train = read_train(Section(root, "train"), c.model);
  c.optim = read_optim(Section(root, "optim"));
  c.data = read_data(Section(root, "data"));
  c.parallel = read_parallel(Section(root, "parallel"));
  read_lora(Section(root, "lora"), c.model);
  read_moe(Section(root, "moe"), c.model);
  MESHTRAIN_CHECK(c.parallel.ep == 1 || c.model.moe.enabled(),
                  "config: parallel.ep = {} needs a mixture-of-experts model (moe.experts > 0)",
                  c.parallel.ep);
  MESHTRAIN_CHECK(c.parallel.ep == 1 || c.model.moe.experts % c.parallel.ep == 0,
                  "config: parallel.ep = {} does not divide moe.experts = {}", c.parallel.ep,
                  c.model.moe.experts);
  MESHTRAIN_CHECK(c.parallel.cp == 1 || c.model.moe.capacity_factor <= 0,
                  "config: moe.capacity_factor = {} with parallel.cp = {}: an expert's capacity "
                  "over a micro-batch cut across the cp ranks is not implemented (use "
                  "moe.capacity_factor = 0, dropless)",
                  c.model.moe.capacity_factor, c.parallel.cp);
  if (parse_cp_comm(c.parallel.cp_comm) == CpComm::alltoall) {
    // Ulysses re-shards each tp rank's heads over the cp ranks.
    const int64_t split = static_cast<int64_t>(c.parallel.tp) * c.parallel.cp;
    MESHTRAIN_CHECK(c.model.n_heads % split == 0 && c.model.n_kv_heads % split == 0,
                    "config: parallel.cp_comm = \"alltoall\" splits the heads over tp x cp = {}: "
                    "model.n_heads = {} and model.n_kv_heads = {} must divide by it",
                    split, c.model.n_heads, c.model.n_kv_heads);
  }
  MESHTRAIN_CHECK(c.parallel.cp == 1 || c.model.sliding_window == 0,
                  "config: model.sliding_window = {} with parallel.cp = {}: context-parallel "
                  "attention has no sliding window (not implemented)",
                  c.model.sliding_window, c.parallel.cp);
  MESHTRAIN_CHECK(c.train.seq_len % (2 * c.parallel.cp) == 0,
                  "config: train.seq_len = {} is not divisible by 2 x parallel.cp = {} (each "
                  "sequence is cut into 2 x cp chunks)",
                  c.train.seq_len, 2 * c.parallel.cp);
  MESHTRAIN_CHECK(!c.model.lora.enabled() || c.parallel.zero <= 2 || c.parallel.offload == "none",
                  "config: lora.rank = {} with parallel.zero = 3 and parallel.offload = \"{}\": "
                  "the frozen base of a LoRA run cannot be offloaded at ZeRO-3 yet (use "
                  "parallel.offload = \"none\", or parallel.zero <= 2)",
                  c.model.lora.rank, c.parallel.offload);
  MESHTRAIN_CHECK(c.model.lora.dropout == 0.0f || c.parallel.pp == 1,
                  "config: lora.dropout = {} with parallel.pp = {}: adapter dropout under "
                  "pipeline parallelism is not implemented yet (use lora.dropout = 0)",
                  c.model.lora.dropout, c.parallel.pp);
  c.ckpt = read_ckpt(Section(root, "ckpt"));
  c.guard = read_guard(Section(root, "guard"));
  c.comm = read_comm(Section(root, "comm"));
  MESHTRAIN_CHECK(c.comm.backend != "nccl" || c.train.device != kHostBackend,
                  "config: comm.backend = \"nccl\" moves device memory, and train.device = \"{}\" "
                  "keeps tensors on the host: use comm.backend = \"auto\" or \"mpi\"",
                  c.train.device);
  c.dpo = read_dpo(Section(root, "dpo"), c);
  return c;
}

// Float settings are written in their shortest decimal form, so a saved
// config reads back to the same float bits.
double exact(float value) { return std::stod(fmt::format("{}", value)); }

toml::table to_table(const TrainConfig& c) {
  const ModelConfig& m = c.model;
  toml::table model{
      {"family", std::string(family_name(m.family))}, {"dim", m.dim},
      {"n_layers", m.n_layers},                       {"n_heads", m.n_heads},
      {"n_kv_heads", m.n_kv_heads},                   {"hidden_dim", m.hidden_dim},
      {"vocab_size", m.vocab_size},                   {"max_seq_len", m.max_seq_len},
      {"norm_eps", exact(m.norm_eps)},                {"rope_theta", exact(m.rope_theta)},
      {"tie_embeddings", m.tie_embeddings},           {"init_std", exact(m.init_std)},
      {"head_dim", m.head_width},                     {"qkv_bias", m.qkv_bias},
      {"qk_norm", std::string(qk_norm_name(m.qk_norm))}, {"sliding_window", m.sliding_window},
  };
  const TrainSettings& t = c.train;
  toml::table train{
      {"precision", std::string(precision_name(t.precision))},
      {"seed", static_cast<int64_t>(t.seed)},
      {"steps", t.steps},
      {"batch_size", t.batch_size},
      {"batch_tokens", t.batch_tokens},
      {"micro_batch_size", t.micro_batch_size},
      {"seq_len", t.seq_len},
      {"device", t.device},
      {"threads", t.threads},
      {"grad_clip", exact(t.grad_clip)},
      {"eval_interval", t.eval_interval},
      {"eval_batches", t.eval_batches},
      {"log_interval", t.log_interval},
      {"peak_flops", t.peak_flops},
      {"checkpoint_interval", t.checkpoint_interval},
      {"out_dir", t.out_dir},
      {"recompute", std::string(recompute_name(t.recompute))},
      {"recompute_layers", t.recompute_layers},
      {"loss_scale_init", t.loss_scale.init},
      {"loss_scale_growth_interval", t.loss_scale.growth_interval},
      {"loss_scale_min", t.loss_scale.min},
      {"straggler_interval", t.straggler_interval},
      {"straggler_threshold", t.straggler_threshold},
      {"memory_check", t.memory_check},
      {"trace_steps", t.trace_steps},
      {"init_from", t.init_from},
  };
  const OptimSettings& o = c.optim;
  toml::table optim{
      {"lr", exact(o.lr)},
      {"min_lr", exact(o.min_lr)},
      {"warmup_steps", o.warmup_steps},
      {"decay", o.decay == LrDecay::cosine ? "cosine" : "constant"},
      {"beta1", exact(o.adamw.beta1)},
      {"beta2", exact(o.adamw.beta2)},
      {"eps", exact(o.adamw.eps)},
      {"weight_decay", exact(o.adamw.weight_decay)},
  };
  toml::array train_files;
  for (const std::string& path : c.data.train) train_files.push_back(path);
  toml::array val_files;
  for (const std::string& path : c.data.val) val_files.push_back(path);
  toml::table data{{"train", std::move(train_files)},
                   {"tokenizer", c.data.tokenizer},
                   {"gpt2_ranks", c.data.gpt2_ranks},
                   {"format", c.data.format},
                   {"sft_pack", c.data.sft_pack},
                   {"sft_overflow", c.data.sft_overflow}};
  if (!c.data.val.empty()) data.insert("val", std::move(val_files));
  const ParallelSettings& p = c.parallel;
  toml::table parallel{{"tp", p.tp},
                       {"sequence_parallel", p.sequence_parallel},
                       {"pp", p.pp},
                       {"ep", p.ep},
                       {"cp", p.cp},
                       {"cp_comm", p.cp_comm},
                       {"bucket_mb", p.bucket_mb},
                       {"overlap", p.overlap},
                       {"zero", p.zero},
                       {"prefetch", p.prefetch},
                       {"reshard_after_forward", p.reshard_after_forward},
                       {"max_inflight_reduces", p.max_inflight_reduces},
                       {"offload", p.offload},
                       {"offload_dir", p.offload_dir},
                       {"offload_budget_mb", p.offload_budget_mb},
                       {"schedule", p.schedule},
                       {"virtual_stages", p.virtual_stages},
                       {"pp_split", p.pp_split}};
  toml::table ckpt{{"buffer_mb", c.ckpt.buffer_mb},
                   {"async", c.ckpt.async},
                   {"keep_last", c.ckpt.keep_last}};
  const GuardSettings& g = c.guard;
  toml::table guard{{"enabled", g.enabled},
                    {"max_skips", g.max_skips},
                    {"window", g.window},
                    {"min_steps", g.min_steps},
                    {"loss_z", g.loss_z},
                    {"grad_z", g.grad_z},
                    {"policy", g.policy == GuardPolicy::skip ? "skip" : "rollback"},
                    {"rollback_skip_batches", g.rollback_skip_batches},
                    {"max_rollbacks", g.max_rollbacks}};
  toml::table comm{{"timeout_s", c.comm.timeout_s},
                   {"long_timeout_s", c.comm.long_timeout_s},
                   {"flight_records", c.comm.flight_records},
                   {"backend", c.comm.backend}};
  toml::table out{{"model", std::move(model)},
                  {"train", std::move(train)},
                  {"optim", std::move(optim)},
                  {"data", std::move(data)},
                  {"parallel", std::move(parallel)},
                  {"ckpt", std::move(ckpt)},
                  {"guard", std::move(guard)},
                  {"comm", std::move(comm)}};
  if (c.data.preference()) {
    const DpoSettings& d = c.dpo.loss;
    out.insert("dpo", toml::table{{"beta", d.beta},
                                  {"loss", d.loss == DpoLoss::ipo ? "ipo" : "sigmoid"},
                                  {"label_smoothing", d.label_smoothing},
                                  {"precompute_reference", c.dpo.precompute_reference}});
  }
  if (m.lora.enabled()) {
    toml::array targets;
    for (const std::string& target : lora_targets(m.lora, m.family)) targets.push_back(target);
    out.insert("lora", toml::table{{"rank", m.lora.rank},
                                   {"alpha", exact(m.lora.alpha)},
                                   {"dropout", exact(m.lora.dropout)},
                                   {"targets", std::move(targets)},
                                   {"quantize_base", std::string(base_quant_name(m.lora.quantize_base))}});
  }
  if (const MoeConfig& e = m.moe; e.enabled()) {
    out.insert("moe", toml::table{{"experts", e.experts},
                                  {"top_k", e.top_k},
                                  {"hidden_dim", e.hidden_dim},
                                  {"score", std::string(router_score_name(e.score))},
                                  {"renormalize", e.renormalize},
                                  {"scaling", exact(e.scaling)},
                                  {"n_groups", e.n_groups},
                                  {"topk_groups", e.topk_groups},
                                  {"shared_hidden", e.shared_hidden},
                                  {"shared_gate", e.shared_gate},
                                  {"first_dense", e.first_dense},
                                  {"every", e.every},
                                  {"aux_loss", exact(e.aux_loss)},
                                  {"z_loss", exact(e.z_loss)},
                                  {"aux_scope", e.aux_per_step ? "step" : "micro_batch"},
                                  {"capacity_factor", exact(e.capacity_factor)},
                                  {"bias_update_rate", exact(e.bias_update_rate)}});
  }
  return out;
}

// JSON values as TOML nodes (integers stay integers), for config_from_json.
void insert_json(toml::table& table, const std::string& key, const nlohmann::json& value);

toml::array json_array(const nlohmann::json& value) {
  toml::array array;
  for (const nlohmann::json& item : value) {
    MESHTRAIN_CHECK(item.is_string(), "config: only arrays of strings are supported");
    array.push_back(item.get<std::string>());
  }
  return array;
}

void insert_json(toml::table& table, const std::string& key, const nlohmann::json& value) {
  if (value.is_object()) {
    toml::table sub;
    for (const auto& [k, v] : value.items()) insert_json(sub, k, v);
    table.insert_or_assign(key, std::move(sub));
  } else if (value.is_array()) {
    table.insert_or_assign(key, json_array(value));
  } else if (value.is_boolean()) {
    table.insert_or_assign(key, value.get<bool>());
  } else if (value.is_number_integer()) {
    table.insert_or_assign(key, value.get<int64_t>());
  } else if (value.is_number_float()) {
    table.insert_or_assign(key, value.get<double>());
  } else if (value.is_string()) {
    table.insert_or_assign(key, value.get<std::string>());
  } else {
    fail("config: {} has an unsupported JSON value", key);
  }
}

}  // namespace

LrSchedule TrainConfig::lr_schedule() const {
  LrSchedule s;
  s.max_lr = optim.lr;
  s.min_lr = optim.min_lr;
  s.warmup_steps = optim.warmup_steps;
  s.total_steps = train.steps;
  s.decay = optim.decay;
  return s;
}

TrainConfig parse_config(const std::string& toml_text, const std::string& source_name,
                         const ConfigOverrides& overrides) {
  toml::table root;
  try {
    root = toml::parse(toml_text, source_name);
  } catch (const toml::parse_error& e) {
    fail("config: {}:{}:{}: {}", source_name, e.source().begin.line, e.source().begin.column,
         e.description());
  }
  for (const auto& [key, value] : overrides) apply_override(root, key, value);
  return from_table(root, true);
}

TrainConfig load_config(const std::string& path, const ConfigOverrides& overrides) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK(in.good(), "config: cannot read '{}'", path);
  std::ostringstream text;
  text << in.rdbuf();
  return parse_config(text.str(), path, overrides);
}

std::string config_to_toml(const TrainConfig& config) {
  std::ostringstream os;
  os << to_table(config) << '\n';
  return os.str();
}

std::string config_to_json(const TrainConfig& config) {
  std::ostringstream os;
  os << toml::json_formatter{to_table(config)};
  return os.str();
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const KeySpec& spec : kKeys) keys.push_back(full_name(spec));
  return keys;
}

TrainConfig config_from_json(const std::string& json_text) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    fail("config: not valid JSON: {}", e.what());
  }
  MESHTRAIN_CHECK(json.is_object(), "config: expected a JSON object");
  toml::table root;
  for (const auto& [key, value] : json.items()) insert_json(root, key, value);
  return from_table(root, false);
}

namespace {

std::vector<std::string> expand_files(const std::vector<std::string>& patterns, const char* key) {
  std::vector<std::string> files;
  for (const std::string& pattern : patterns) {
    if (pattern.find_first_of("*?[") == std::string::npos) {
      files.push_back(pattern);
      continue;
    }
    glob_t matches{};
    int rc = ::glob(pattern.c_str(), 0, nullptr, &matches);
    if (rc == 0) {
      // glob(3) sorts its matches.
      for (size_t i = 0; i < matches.gl_pathc; ++i) files.emplace_back(matches.gl_pathv[i]);
    }
    ::globfree(&matches);
    MESHTRAIN_CHECK(rc == 0, "config: {}: no file matches '{}'", key, pattern);
  }
  return files;
}

}  // namespace

std::vector<std::string> expand_train_files(const DataSettings& data) {
  return expand_files(data.train, "data.train");
}

std::vector<std::string> expand_val_files(const DataSettings& data) {
  return expand_files(data.val, "data.val");
}

}  // namespace meshtrain
