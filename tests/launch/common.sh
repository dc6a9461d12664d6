# Sourced by the launch tests with MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR:
# the CLI tests' byte corpus (tests/cli/make_inputs.sh) and helpers.
source "$(dirname "${BASH_SOURCE[0]}")/../support/cli_common.sh" "$@"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# A dp 2 run of llama-tiny, a checkpoint every 3 steps.
train_args() {  # OUT_DIR [more overrides]
  local out=$1; shift
  echo train --config "$work/good.toml" --train.steps "${steps:-36}" --train.checkpoint_interval 3 \
    --train.eval_interval 0 --train.log_interval 6 --train.threads 1 --train.out_dir "$out" "$@"
}
# The rank processes of a run (their command line starts with the binary).
rank_pids() { pgrep -f "^$bin train .*--train.out_dir $1( |\$)" || true; }
# Steps recorded in a run's rank-0 metrics so far.
steps_done() { local n; n=$(grep -c '"loss"' "$1/metrics.jsonl" 2>/dev/null); echo "${n:-0}"; }
# Waits until the run in OUT has logged at least N steps (false if TIMEOUT s pass).
wait_steps() {  # OUT N TIMEOUT
  local deadline=$((SECONDS + $3))
  while (( SECONDS < deadline )); do
    (( $(steps_done "$1") >= $2 )) && return 0
    sleep 0.02
  done
  return 1
}
# The final checkpoints of two runs hold the same tensors, bit for bit.
same_checkpoint() { python3 "$here/same_checkpoint.py" "$1" "$2"; }
# A fresh $out and the uninterrupted run of RANKS ranks in $out/plain (more overrides after).
reference_run() {  # NAME RANKS [overrides]
  out=$work/$1; local ranks=$2; shift 2
  rm -rf "$out" && mkdir -p "$out"
  "${mpirun[@]}" "$ranks" "$bin" $(train_args "$out/plain") "$@" >"$out/plain.log" 2>&1 ||
    { cat "$out/plain.log"; fail "the uninterrupted run failed"; }
}
# RANDOM seeded from MESHTRAIN_TEST_SEED (or the clock), printed with the test's choices.
seed_random() { seed=${MESHTRAIN_TEST_SEED:-$(( $(date +%s) % 1000 ))}; RANDOM=$seed; }
