// The subcommands that run as one rank of a job (under mpirun/srun, or alone
// as a single rank): train, eval and bench comm. On a multi-rank run, an error on
// any rank is printed as "rank R: <message>" and ends the whole job
// (comm/abort.h); a single rank throws it to main() like any other command.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/train/config.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain {

// `options`: resume / overwrite / allow_config_change as given (the mesh is set here).
int run_train_ranks(const std::string& config_path, const ConfigOverrides& overrides,
                    const TrainerOptions& options);

struct EvalArgs {
  std::string checkpoint;
  std::vector<std::string> data;  // files or globs
  EvalOptions options;
  std::string logits_ids, logits_out;  // "1,2,3" and a .safetensors path
};
// Prints loss and perplexity (rank 0); with --logits-ids, writes the model's
// logits [ids, vocab] f32 for that sequence as tensor "logits".
int run_eval_ranks(const EvalArgs& args);

struct BenchCommArgs {
  bool quick = false;
  std::string min_size, max_size;  // "4K", "256M", bytes
  std::vector<std::string> ops;    // all_reduce reduce_scatter all_gather broadcast sendrecv
};
int run_bench_comm(const BenchCommArgs& args);

}  // namespace meshtrain
