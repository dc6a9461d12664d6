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
# PID and every process below it.
descendants() {  # PID
  echo "$1"
  local c
  for c in $(pgrep -P "$1"); do descendants "$c"; done
}
# Waits for the background job PID (its exit status), at most TIMEOUT s. Past
# that, a hang: prints each process of the job with its kernel wait channel and,
# where gdb is installed, every thread's backtrace, then kills the job and fails.
wait_job() {  # PID TIMEOUT WHAT LOG
  local deadline=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.05; done
  kill -0 "$1" 2>/dev/null || { wait "$1"; return; }
  local pids p
  pids=$(descendants "$1")
  echo "$3: still running after $2 s; its processes:"
  ps -o pid,ppid,stat,etime,wchan:24,args -p "$(echo $pids | tr ' ' ,)" | cut -c1-220
  if command -v gdb >/dev/null; then
    for p in $pids; do
      echo "--- backtraces of $p"
      timeout 30 gdb -q -batch -p "$p" -ex "thread apply all bt 25" 2>/dev/null | grep -E "^(Thread|#)" | cut -c1-200 | head -80
    done
  fi
  echo "--- the end of $4"; tail -20 "$4"
  kill -KILL $pids 2>/dev/null
  fail "$3 hung"
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
