// meshtrain's command line: train, launch, eval, sample, prepare, ckpt export/import, debug
// hang, report. Thin
// glue over the library (train/, data/, ckpt/); any error becomes one line on stderr.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/backend/registry.h"
#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/llama2c.h"
#include "meshtrain/ckpt/llmc.h"
#include "meshtrain/ckpt/lora_export.h"
#include "meshtrain/cli/args.h"
#include "meshtrain/cli/launch_command.h"
#include "meshtrain/cli/ops_command.h"
#include "meshtrain/cli/tokenize_command.h"
#include "meshtrain/cli/plan_command.h"
#include "meshtrain/cli/ranks.h"
#include "meshtrain/comm/flight_dump.h"
#include "meshtrain/data/bpe_tokenizer.h"
#include "meshtrain/data/prepare.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/report/run_report.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

struct TrainArgs {
  std::string config;
  TrainerOptions options;
};

// One rank of a job (mpirun -np N meshtrain train ...), or the only one.
int run_train(const TrainArgs& args, const std::vector<std::string>& extras) {
  return run_train_ranks(args.config, parse_overrides(extras), args.options);
}

struct SampleArgs {
  std::string checkpoint, model_file, prompt_ids, prompt, precision = "fp32";
  std::string tokenizer, gpt2_ranks;  // empty = the run's (train_state.json), else by vocabulary
  float temperature = 1.0f;
  int64_t top_k = 0, max_new_tokens = -1;  // -1: up to 256, within the context
  uint64_t seed = 0;
  int threads = 0;
  bool print_ids = false;
  bool stop_at_eos = false;
};

// Text output: a byte-level vocabulary escapes control bytes other than newline and tab. A
// model's vocabulary may be larger than its tokenizer's (an HF model with 512 ids fine-tuned on
// bytes): an id the tokenizer lacks is printed as <|id N|> (docs/interop.md).
void print_text(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  std::string text;
  auto append = [&](std::span<const int32_t> known) {
    std::string raw = tokenizer.decode(known);
    if (tokenizer.name() != "bytes") {
      text += raw;
      return;
    }
    for (unsigned char c : raw) {
      if (c == '\n' || c == '\t' || (c >= 32 && c != 127)) {
        text.push_back(static_cast<char>(c));
      } else {
        text += fmt::format("\\x{:02x}", c);
      }
    }
  };
  size_t start = 0;  // of the current run of ids the tokenizer has
  for (size_t i = 0; i <= ids.size(); ++i) {
    if (i < ids.size() && ids[i] >= 0 && ids[i] < tokenizer.vocab_size()) continue;
    append(std::span(ids).subspan(start, i - start));
    if (i < ids.size()) text += fmt::format("<|id {}|>", ids[i]);
    start = i + 1;
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
}

// The tokenizer that gives the model's ids their meaning: --tokenizer, else the
// training run's (the files its checkpoint carries, or its data.tokenizer), else
// guessed from the vocabulary (256: bytes, 50257: GPT-2); null when none is
// known (ids are printed instead).
std::unique_ptr<Tokenizer> sample_tokenizer(const SampleArgs& args, int64_t vocab) {
  std::string ranks = args.gpt2_ranks;
  std::unique_ptr<Tokenizer> tokenizer;
  const bool run = !args.checkpoint.empty() && is_training_checkpoint(args.checkpoint);
  if (run && ranks.empty()) {
    TrainConfig saved;
    read_train_state(args.checkpoint, &saved);
    ranks = checkpoint_gpt2_ranks(args.checkpoint, saved);
  }
  if (ranks.empty()) ranks = kDefaultGpt2Ranks;
  if (!args.tokenizer.empty()) {
    tokenizer = make_tokenizer(args.tokenizer, ranks);
    if (tokenizer->vocab_size() > vocab) {
      throw UsageError(fmt::format("sample: tokenizer '{}' has {} ids, the model only {}",
                                   args.tokenizer, tokenizer->vocab_size(), vocab));
    }
    return tokenizer;
  }
  if (run) tokenizer = checkpoint_tokenizer(args.checkpoint);  // null: not the model's ids
  if (tokenizer) return tokenizer;
  const std::string guess = vocab == 256 ? "bytes" : vocab == 50257 ? "gpt2" : "";
  return guess.empty() ? nullptr : make_tokenizer(guess, ranks);
}

void run_sample(const SampleArgs& args) {
  MemoryTracker tracker;
  const std::unique_ptr<Backend> backend = make_backend(kHostBackend, args.threads, tracker);
  Precision precision = parse_precision(args.precision);
  std::unique_ptr<Model> model = args.checkpoint.empty()
                                     ? import_llama2c(args.model_file, precision, *backend)
                                     : load_model_dir(args.checkpoint, precision, *backend);
  std::unique_ptr<Tokenizer> tokenizer = sample_tokenizer(args, model->config().vocab_size);
  std::vector<int32_t> prompt;
  bool default_prompt = false;
  if (!args.prompt.empty()) {
    if (!tokenizer) {
      throw UsageError(fmt::format("sample: --prompt needs a tokenizer for this model (vocab {}); "
                                   "use --tokenizer or --prompt-ids", model->config().vocab_size));
    }
    tokenizer->encode(args.prompt, prompt, /*add_special=*/true);  // its BOS, as HF tokenizers add it
  } else if (!args.prompt_ids.empty()) {
    prompt = parse_token_ids(args.prompt_ids);
  } else {
    // A document start: the tokenizer's own (GPT-2's <|endoftext|>, Llama's
    // BOS), a newline for bytes, llama2.c's BOS.
    default_prompt = true;
    prompt = {!tokenizer                     ? int32_t{1}
              : tokenizer->name() == "bytes" ? int32_t{'\n'}
                                             : tokenizer->document_frame().before.empty()
                                                   ? tokenizer->eot_id()
                                                   : tokenizer->document_frame().before.front()};
  }
  SampleOptions options;
  options.temperature = args.temperature;
  options.top_k = args.top_k;
  options.seed = args.seed;
  if (args.stop_at_eos) {
    if (!tokenizer) throw UsageError("sample: --stop-at-eos needs the model's tokenizer (--tokenizer)");
    options.stop_id = tokenizer->eot_id();
  }
  const int64_t room = model->config().max_seq_len - static_cast<int64_t>(prompt.size());
  options.max_new_tokens =
      args.max_new_tokens >= 0 ? args.max_new_tokens : std::clamp<int64_t>(room, 0, 256);
  const bool stream = tokenizer && !args.print_ids;
  if (stream && !default_prompt) {
    print_text(*tokenizer, prompt);
    std::fflush(stdout);
  }
  std::vector<int32_t> out = generate(*model, prompt, options, [&](int32_t id) {
    if (stream) {
      print_text(*tokenizer, {id});
      std::fflush(stdout);
    }
  });
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), out.begin(), out.end());
  if (stream) {
    std::fputc('\n', stdout);
    return;
  }
  fmt::print("{}\n", fmt::join(all, ","));  // --print-ids, or no tokenizer: ids are all there is
  if (tokenizer) {
    print_text(*tokenizer, all);
    std::fputc('\n', stdout);
  }
}

struct CkptArgs {
  std::string format, checkpoint, in, out, dtype = "f32";
  std::string tokenizer, gpt2_ranks = kDefaultGpt2Ranks;  // tokenizer files for the export
  std::string base_model;  // export peft: base_model_name_or_path; import peft: the base directory
  bool merge_lora = false, base_only = false;  // a LoRA checkpoint to hf / llmc / llama2c
  int threads = 0;
};

// What a checkpoint with LoRA adapters exports as: the base with the adapters
// merged in (--merge-lora), the frozen base alone (--base-only), or (peft) the
// adapters alone; a plain format without either flag is refused, as it would
// drop or misplace the adapters. `config` and `source` become the model written.
void select_lora_export(const CkptArgs& args, ModelConfig& config, TensorSource& source) {
  const bool lora = config.lora.enabled();
  if (args.format == "peft") {
    MESHTRAIN_CHECK_AS(ErrorKind::config, lora,
                       "ckpt export: '{}' has no LoRA adapters (lora.rank = 0): nothing for "
                       "--format peft", args.checkpoint);
    MESHTRAIN_CHECK_AS(ErrorKind::config, !args.merge_lora && !args.base_only,
                       "ckpt export: --format peft writes the adapters alone; --merge-lora and "
                       "--base-only are for --format hf, llmc or llama2c");
    return;
  }
  if (!lora) {
    MESHTRAIN_CHECK_AS(ErrorKind::config, !args.merge_lora && !args.base_only,
                       "ckpt export: '{}' has no LoRA adapters (lora.rank = 0): drop --{}",
                       args.checkpoint, args.merge_lora ? "merge-lora" : "base-only");
    return;
  }
  MESHTRAIN_CHECK_AS(ErrorKind::config, args.merge_lora || args.base_only,
                     "ckpt export: '{}' has LoRA adapters (lora.rank = {}): --format {} needs "
                     "--merge-lora (the base with the adapters merged in) or --base-only (the "
                     "frozen base); --format peft writes the adapters alone",
                     args.checkpoint, config.lora.rank, args.format);
  if (args.merge_lora) source = merge_lora(config, std::move(source));
  config = without_lora(config);
}

// The tokenizer an export carries: --tokenizer, else a training run's own; null when neither.
std::unique_ptr<Tokenizer> export_tokenizer(const CkptArgs& args, const std::string& source) {
  if (!args.tokenizer.empty()) return make_tokenizer(args.tokenizer, args.gpt2_ranks);
  return source.empty() ? nullptr : checkpoint_tokenizer(source);
}

void add_tokenizer_options(CLI::App& command, CkptArgs& args) {
  command.add_option("--tokenizer", args.tokenizer,
                     "Tokenizer files to write: gpt2, bytes, a tokenizer file or folder (default: "
                     "a training run's)");
  command.add_option("--gpt2-ranks", args.gpt2_ranks, "GPT-2 ranks file for --tokenizer gpt2")
      ->capture_default_str();
}

void run_export(const CkptArgs& args) {
  // A training checkpoint's files must never be replaced by an export.
  const std::filesystem::path out(args.out);
  for (const std::filesystem::path& dir : {out, out.parent_path()}) {
    if (!dir.empty() && is_training_checkpoint(dir.string())) {
      fail("ckpt export: --out '{}' is inside the training checkpoint '{}'; export elsewhere",
           args.out, dir.string());
    }
  }
  const DType dtype = parse_dtype(args.dtype);
  const std::unique_ptr<Tokenizer> tokenizer = export_tokenizer(args, args.checkpoint);
  // A sharded checkpoint is read tensor by tensor (memory stays at one tensor);
  // anything else, and a QLoRA checkpoint (no NF4 base in it: rebuilt from
  // its run's start), through a model in memory.
  MemoryTracker tracker;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
  ModelConfig config;
  TensorSource source;
  dist_ckpt::Manifest manifest;
  TrainConfig run;
  const bool sharded = dist_ckpt::is_sharded_checkpoint(args.checkpoint);
  if (sharded) read_train_state(args.checkpoint, &run);
  if (sharded && run.model.lora.quantize_base == BaseQuant::none) {
    dist_ckpt::verify_checkpoint(args.checkpoint);
    manifest = dist_ckpt::read_manifest(args.checkpoint);
    config = run.model;
    source = [&](const ParamSpec& spec, float* dst) {
      dist_ckpt::read_global_tensor(manifest, args.checkpoint, spec.name,
                                    layout::StateKind::master, dst);
    };
  } else {
    backend = make_backend(kHostBackend, args.threads, tracker);
    model = load_model_dir(args.checkpoint, Precision::fp32, *backend);
    config = model->config();
    source = model_tensors(*model);
  }
  select_lora_export(args, config, source);
  if (args.format == "peft") {
    export_peft(config, source, args.out, args.base_model, dtype);
  } else if (args.format == "hf") {
    export_hf(config, source, args.out, dtype, tokenizer.get());
    if (!tokenizer && !is_training_checkpoint(args.checkpoint)) {
      copy_hf_tokenizer(args.checkpoint, args.out);  // an HF directory's own tokenizer
    }
  } else if (args.format == "llmc") {
    export_llmc(config, source, args.out, dtype, tokenizer.get());
  } else {
    export_llama2c(config, source, args.out, tokenizer.get());
  }
  fmt::print("exported {} to {} ({})\n", args.checkpoint, args.out, args.format);
}

// A PEFT adapter merged into its Hugging Face base: a plain HF directory (with the base's tokenizer).
void run_import_peft(const CkptArgs& args, Backend& backend) {
  MESHTRAIN_CHECK_AS(ErrorKind::config, !args.base_model.empty(),
                     "ckpt import: --format peft needs --base, the Hugging Face directory the "
                     "adapter was trained on");
  std::unique_ptr<Model> base = import_hf(args.base_model, Precision::fp32, backend);
  const PeftAdapter adapter = read_peft_adapter(args.in, base->config());
  const std::unique_ptr<Tokenizer> tokenizer = export_tokenizer(args, "");
  export_hf(base->config(), merge_lora(adapter.config, with_adapter(model_tensors(*base), adapter)),
            args.out, parse_dtype(args.dtype), tokenizer.get());
  if (!tokenizer) copy_hf_tokenizer(args.base_model, args.out);
  fmt::print("imported {} (peft, r = {}) merged into {} to {}\n", args.in, adapter.config.lora.rank,
             args.base_model, args.out);
}

void run_import(const CkptArgs& args) {
  MemoryTracker tracker;
  const std::unique_ptr<Backend> backend = make_backend(kHostBackend, args.threads, tracker);
  if (args.format == "peft") return run_import_peft(args, *backend);
  std::unique_ptr<Model> model =
      args.format == "llama2c" ? import_llama2c(args.in, Precision::fp32, *backend)
      : args.format == "llmc"  ? import_llmc(args.in, Precision::fp32, *backend)
                               : import_hf(args.in, Precision::fp32, *backend);
  const std::unique_ptr<Tokenizer> tokenizer = export_tokenizer(args, "");
  export_hf(*model, args.out, parse_dtype(args.dtype), tokenizer.get());
  if (!tokenizer && args.format == "hf") copy_hf_tokenizer(args.in, args.out);
  fmt::print("imported {} ({}) to {}: {} params\n", args.in, args.format, args.out,
             model->num_params());
}

// The subcommand words at the front of the command line must name subcommands: CLI11 would
// otherwise answer `meshtrain tokenize --help` with the main help and exit 0.
void check_subcommands(const CLI::App& app, int argc, char** argv) {
  const CLI::App* level = &app;
  for (int i = 1; i < argc && argv[i][0] != '-'; ++i) {
    const std::vector<const CLI::App*> known = level->get_subcommands({});
    if (known.empty()) return;  // positional arguments from here on
    const auto found = std::find_if(known.begin(), known.end(),
                                    [&](const CLI::App* s) { return s->check_name(argv[i]); });
    if (found == known.end()) {
      std::vector<std::string> names;
      for (const CLI::App* s : known) names.push_back(s->get_name());
      const std::string of = level == &app ? "" : fmt::format(" of '{}'", level->get_name());
      throw UsageError(fmt::format("unknown subcommand '{}'{} (one of: {}; see --help)", argv[i],
                                   of, fmt::join(names, ", ")));
    }
    level = *found;
  }
}


int main_impl(int argc, char** argv) {
  CLI::App app{"meshtrain: trains decoder-only language models (Llama, GPT-2)"};
  app.require_subcommand(1);

  TrainArgs train_args;
  CLI::App* train = app.add_subcommand("train", "Train a model from a TOML config");
  train->add_option("--config", train_args.config, "TOML file (keys: docs/config.md)")->required();
  train->add_option("--resume", train_args.options.resume_dir,
                    "Resume from a step directory (out_dir/step_N), or 'auto': out_dir's newest "
                    "checkpoint that verifies (none: start fresh)");
  train->add_flag("--overwrite", train_args.options.overwrite,
                  "Start fresh in an out_dir that holds another run (its files are deleted)");
  train->add_flag("--allow-config-change", train_args.options.allow_config_change,
                  "Resume although settings that break exact continuation changed");
  train->allow_extras();
  train->footer("Any config key can be overridden: --section.key value (e.g. --train.steps 100)");

  SampleArgs sample_args;
  CLI::App* sample = app.add_subcommand("sample", "Generate tokens from saved weights");
  auto* ckpt_opt = sample->add_option("--checkpoint", sample_args.checkpoint,
                                      "Training step directory or Hugging Face directory");
  auto* file_opt = sample->add_option("--model-file", sample_args.model_file,
                                      "llama2.c checkpoint (.bin)");
  ckpt_opt->excludes(file_opt);
  sample->add_option("--temperature", sample_args.temperature, "0 = greedy")
      ->check(CLI::Range(0.0f, 100.0f))->capture_default_str();
  sample->add_option("--top-k", sample_args.top_k, "0 = whole vocabulary")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  sample->add_option("--seed", sample_args.seed)->capture_default_str();
  sample->add_option("--max-new-tokens", sample_args.max_new_tokens,
                     "prompt + new must fit max_seq_len (default: 256 or the context left)")
      ->check(CLI::NonNegativeNumber);
  sample->add_option("--prompt-ids", sample_args.prompt_ids, "Comma-separated token ids");
  sample->add_option("--prompt", sample_args.prompt, "Prompt text, encoded with the tokenizer");
  sample->add_option("--tokenizer", sample_args.tokenizer,
                     "Token meaning: gpt2, bytes, a tokenizer file or folder (default: the run's)");
  sample->add_option("--gpt2-ranks", sample_args.gpt2_ranks,
                     "GPT-2 ranks file (default: the run's data.gpt2_ranks)");
  sample->add_flag("--print-ids", sample_args.print_ids, "Print the token ids");
  sample->add_flag("--stop-at-eos", sample_args.stop_at_eos,
                   "End after the tokenizer's end-of-sequence token (a chat model's end of turn)");
  sample->add_option("--precision", sample_args.precision)
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))->capture_default_str();
  sample->add_option("--threads", sample_args.threads, "0 = cores available")
      ->check(CLI::NonNegativeNumber);

  EvalArgs eval_args;
  CLI::App* eval = app.add_subcommand(
      "eval", "Loss and perplexity of a checkpoint on token shards or an SFT run's JSONL records "
              "(runs under mpirun too)");
  eval->add_option("--checkpoint", eval_args.checkpoint,
                   "Training step directory or Hugging Face directory")->required();
  eval->add_option("--data", eval_args.data,
                   "Token files or globs ('data/val_*.bin'); an SFT run's JSONL records too")
      ->required();
  eval->add_option("--batches", eval_args.options.batches,
                   "Global batches (default: the run's train.eval_batches, else 8)")
      ->check(CLI::PositiveNumber);
  eval->add_option("--batch-size", eval_args.options.batch_size,
                   "Windows per batch (default: the run's train.batch_size, else 8)")
      ->check(CLI::PositiveNumber);
  eval->add_option("--micro-batch-size", eval_args.options.micro_batch_size,
                   "Rows per forward (default: the run's train.micro_batch_size)")
      ->check(CLI::PositiveNumber);
  eval->add_option("--seq-len", eval_args.options.seq_len,
                   "Window length (default: the run's train.seq_len, else max_seq_len)")
      ->check(CLI::PositiveNumber);
  eval->add_option("--logits-ids", eval_args.logits_ids,
                   "Comma-separated ids: also write the model's logits for them");
  eval->add_option("--logits-out", eval_args.logits_out, "safetensors file for --logits-ids");
  eval->add_option("--threads", eval_args.options.threads, "0 = cores available")
      ->check(CLI::NonNegativeNumber);

  CLI::App* ckpt = app.add_subcommand("ckpt", "Convert weights to and from other formats");
  ckpt->require_subcommand(1);
  CkptArgs export_args, import_args;
  CLI::App* exp = ckpt->add_subcommand(
      "export", "Write a checkpoint as Hugging Face, llama2.c or llm.c, or its LoRA adapters as PEFT");
  exp->add_option("--format", export_args.format)->required()
      ->check(CLI::IsMember({"hf", "llama2c", "llmc", "peft"}));
  exp->add_flag("--merge-lora", export_args.merge_lora,
                "LoRA checkpoint: write the base with the adapters merged in (W + alpha/r * B A)");
  exp->add_flag("--base-only", export_args.base_only,
                "LoRA checkpoint: write the frozen base model alone (the adapters dropped)");
  exp->add_option("--base-model", export_args.base_model,
                  "peft: the base model's name or path (adapter_config.json base_model_name_or_path)");
  exp->add_option("--checkpoint", export_args.checkpoint, "Training step or Hugging Face directory")
      ->required();
  exp->add_option("--out", export_args.out, "Output directory (hf, peft) or file (llama2c, llmc)")->required();
  exp->add_option("--dtype", export_args.dtype, "weight dtype (hf: f32, bf16, f16; llmc: f32, bf16)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))->capture_default_str();
  add_tokenizer_options(*exp, export_args);
  CkptArgs inspect_args;
  bool inspect_verify = false;
  CLI::App* inspect = ckpt->add_subcommand("inspect", "Show a checkpoint's layout, tensors and sizes");
  inspect->add_option("dir", inspect_args.checkpoint, "Checkpoint directory (out_dir/step_N)")->required();
  inspect->add_flag("--verify", inspect_verify, "Check every file's size and checksum");
  CkptArgs convert_args;
  CLI::App* convert = ckpt->add_subcommand(
      "convert", "Rewrite a whole-tensor checkpoint (model.safetensors + train_state.json) as a sharded one");
  convert->add_option("--in", convert_args.in, "Old-format step directory")->required();
  convert->add_option("--out", convert_args.out, "New step directory")->required();
  CLI::App* imp = ckpt->add_subcommand(
      "import", "Read llama2.c, llm.c or Hugging Face weights, or a PEFT LoRA adapter merged into its base");
  imp->add_option("--format", import_args.format)->required()
      ->check(CLI::IsMember({"hf", "llama2c", "llmc", "peft"}));
  imp->add_option("--in", import_args.in,
                  "llama2.c or llm.c file, or Hugging Face or PEFT adapter directory")->required();
  imp->add_option("--base", import_args.base_model,
                  "peft: the Hugging Face directory of the base model (the output is the base with "
                  "the adapter merged in)");
  imp->add_option("--out", import_args.out, "Output (Hugging Face) directory")->required();
  imp->add_option("--dtype", import_args.dtype, "stored weight dtype")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))->capture_default_str();
  add_tokenizer_options(*imp, import_args);

  PrepareOptions prepare_args;
  CLI::App* prepare = app.add_subcommand("prepare", "Tokenize text into llm.c token shards");
  prepare->add_option("--input", prepare_args.inputs, "Text files or directories (*.txt)")
      ->required();
  prepare->add_option("--out", prepare_args.output_dir, "Output directory for the shards")
      ->required();
  prepare->add_option("--tokenizer", prepare_args.tokenizer,
                      "gpt2, bytes, a tokenizer.json, a tokenizer.model, or a model folder")
      ->capture_default_str();
  prepare->add_option("--gpt2-ranks", prepare_args.gpt2_ranks, "tiktoken ranks file")
      ->capture_default_str();
  prepare->add_option("--shard-tokens", prepare_args.shard_tokens)
      ->check(CLI::PositiveNumber)->capture_default_str();
  prepare->add_option("--val-fraction", prepare_args.val_fraction,
                      "Share of documents held out for validation")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  prepare->add_option("--seed", prepare_args.seed)->capture_default_str();
  prepare->add_option("--separator", prepare_args.separator, "Splits files into documents");
  prepare->add_option("--threads", prepare_args.threads, "0 = cores available")
      ->check(CLI::NonNegativeNumber);
  prepare->add_option("--progress", prepare_args.progress)
      ->check(CLI::IsMember({"auto", "bar", "lines", "none"}))->capture_default_str();

  BenchCommArgs bench_comm_args;
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  CLI::App* bench_comm = bench->add_subcommand(
      "comm", "Collectives' time and bandwidth (nccl-tests definitions), meshtrain vs raw MPI; "
              "run under mpirun -np N");
  bench_comm->add_flag("--quick", bench_comm_args.quick, "Sizes up to 16M, fewer iterations");
  bench_comm->add_option("--min-size", bench_comm_args.min_size, "Smallest message (default 4K)");
  bench_comm->add_option("--max-size", bench_comm_args.max_size, "Largest message (default 256M)");
  bench_comm->add_option("--ops", bench_comm_args.ops,
                         "all_reduce reduce_scatter all_gather broadcast sendrecv (default: all)");

  std::string hang_dir;
  CLI::App* debug = app.add_subcommand("debug", "Diagnose a failed run");
  debug->require_subcommand(1);
  CLI::App* hang = debug->add_subcommand(
      "hang", "Read a hung run's flight records (out_dir/flight/<job>/) and say where it is stuck");
  hang->add_option("dir", hang_dir, "The run's out_dir, or a flight record directory")->required();
  LaunchArgs launch_args;
  CLI::App* launch = app.add_subcommand(
      "launch", "Supervise a training job: relaunch it with --resume auto when it fails (docs/launch.md)");
  add_launch_options(*launch, launch_args);

  std::string report_dir, report_out;
  CLI::App* report = app.add_subcommand(
      "report", "Write a run's report.html (self-contained: inline SVG) and report.json (docs/report.md)");
  report->add_option("run_dir", report_dir, "The run's out_dir")->required();
  report->add_option("--out", report_out, "The HTML file (default RUN_DIR/report.html; report.json beside it)");

  PlanArgs plan_args;
  CLI::App* plan = app.add_subcommand(
      "plan", "Memory, parallelism layout, time and cost of a training run on GPUs (docs/plan.md)");
  add_plan_options(*plan, plan_args);

  OpsArgs ops_args;
  const OpsCommands ops = add_ops_commands(app, ops_args);

  TokenizeArgs tokenize_args;
  CLI::App* tokenize = add_tokenize_command(app, tokenize_args);

  check_subcommands(app, argc, argv);
  if (const std::optional<int> done = parse_command_line(app, argc, argv)) return *done;
  if (sample->parsed() && sample_args.checkpoint.empty() && sample_args.model_file.empty()) {
    throw UsageError("sample: --checkpoint or --model-file is required");
  }

  if (train->parsed()) {
    return run_train(train_args, train->remaining());
  } else if (launch->parsed()) {
    return run_launch(launch_args);
  } else if (plan->parsed()) {
    return run_plan(plan_args);
  } else if (tokenize->parsed()) {
    return run_tokenize(tokenize_args);
  } else if (ops.test->parsed() || ops.perf->parsed() || ops.nccl->parsed()) {
    return run_ops(ops, ops_args);
  } else if (eval->parsed()) {
    if (eval_args.logits_ids.empty() != eval_args.logits_out.empty()) {
      throw UsageError("eval: --logits-ids and --logits-out go together");
    }
    return run_eval_ranks(eval_args);
  } else if (bench_comm->parsed()) {
    return run_bench_comm(bench_comm_args);
  } else if (sample->parsed()) {
    run_sample(sample_args);
  } else if (prepare->parsed()) {
    return run_prepare(prepare_args);
  } else if (exp->parsed()) {
    run_export(export_args);
  } else if (imp->parsed()) {
    run_import(import_args);
  } else if (inspect->parsed()) {
    int failed = 0;
    fmt::print("{}", dist_ckpt::describe_checkpoint(inspect_args.checkpoint, inspect_verify, &failed));
    std::fflush(stdout);
    // A failed check is an error: one line naming the (first) bad file, exit 1.
    if (failed > 0) dist_ckpt::verify_checkpoint(inspect_args.checkpoint);
  } else if (report->parsed()) {
    const report::ReportFiles files = report::write_report(report_dir, report_out);
    fmt::print("report: {}\nsummary: {}\n", files.html, files.json);
  } else if (hang->parsed()) {
    const std::string dir = find_flight_dir(hang_dir);
    fmt::print("{}", format_hang_report(diagnose_hang(read_flight_dumps(dir)), dir));
  } else if (convert->parsed()) {
    dist_ckpt::convert_legacy_checkpoint(convert_args.in, convert_args.out);
    fmt::print("converted {} to {}\n", convert_args.in, convert_args.out);
  }
  return 0;
}

}  // namespace
}  // namespace meshtrain

int main(int argc, char** argv) {
  return meshtrain::run_guarded([&] { return meshtrain::main_impl(argc, argv); });
}
