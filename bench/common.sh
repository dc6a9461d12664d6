# Sourced by the benchmarks that train llama-60M under mpirun (zero_stages.sh,
# pipeline_schedules.sh, ddp_vs_torch.sh) from the repository root: BIN,
# MPIRUN (1 thread per rank), a scratch directory $work (kept and printed with
# KEEP=1), random_tokens and write_run_config.
BIN=${MESHTRAIN_BIN:-build/meshtrain}
[ -x "$BIN" ] || { echo "build first (or set MESHTRAIN_BIN)" >&2; exit 1; }
MPIRUN=(mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi
work=$(mktemp -d)
if [ -n "${KEEP:-}" ]; then echo "runs in $work" >&2; else trap 'rm -rf "$work"' EXIT; fi

# random_tokens COUNT [VOCAB=50257] [SEED=1]: $work/train.bin, COUNT random token ids
# below VOCAB (GPT-2's by default) in llm.c's format (throughput only).
random_tokens() {
  python3 tests/support/random_tokens.py "$work/train.bin" "$1" "${2:-50257}" "${3:-1}"
}

# write_run_config < KEYS: $work/run.toml, llama-60M on $work/train.bin at
# sequence 256, 1 thread, no evaluation or checkpoints; stdin adds [train] keys
# (steps, batch sizes, precision) and may then open other tables.
write_run_config() {
  {
    cat <<TOML
[model]
preset = "llama-60M"
[train]
seq_len = 256
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
TOML
    cat
    printf '[data]\ntrain = "%s"\n' "$work/train.bin"
  } >"$work/run.toml"
}
