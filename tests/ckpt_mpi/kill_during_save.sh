#!/usr/bin/env bash
# kill -9 of one rank of a 2-rank job at random instants while it checkpoints
# every step: `latest`, when present, always names a checkpoint that
# verifies, and `--resume auto` finishes the run from it.
# usage: kill_during_save.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/../support/cli_common.sh"
out="$work/kill_during_save"
rm -rf "$out" && mkdir -p "$out"
python3 "$(dirname "$0")/../support/random_tokens.py" "$out/train.bin" 200000 256 3
# ~3.4M parameters: ~40 MB of checkpoint per step, written every step.
cat >"$out/run.toml" <<TOML
[model]
family = "llama"
dim = 256
n_layers = 4
n_heads = 4
n_kv_heads = 2
hidden_dim = 688
vocab_size = 256
max_seq_len = 64
[train]
steps = 400
batch_size = 4
seq_len = 32
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = 1
out_dir = "$out/run"
[ckpt]
keep_last = 2
[data]
train = "$out/train.bin"
tokenizer = "bytes"
TOML
RANDOM=7
for attempt in 1 2 3 4; do
  resume=(); [ "$attempt" -gt 1 ] && resume=(--resume auto)
  "${mpirun[@]}" 2 "$bin" train --config "$out/run.toml" "${resume[@]}" >"$out/log.$attempt" 2>&1 &
  job=$!
  sleep "$(( 2 + RANDOM % 3 )).$(( RANDOM % 10 ))"
  victim=$(pgrep -f "$bin train --config $out/run.toml" | grep -v "^$job\$" | shuf -n 1 --random-source=<(yes))
  [ -n "$victim" ] || { cat "$out/log.$attempt"; fail "no rank to kill (attempt $attempt)"; }
  kill -9 "$victim"
  wait "$job" 2>/dev/null
  # No rank left behind.
  sleep 1
  ! pgrep -f "$bin train --config $out/run.toml" >/dev/null || fail "ranks left running after the kill"
  if [ -f "$out/run/latest" ]; then
    latest=$(cat "$out/run/latest")
    "$bin" ckpt inspect --verify "$out/run/$latest" >/dev/null ||
      fail "attempt $attempt: latest names $latest, which does not verify"
    echo "attempt $attempt: killed rank pid $victim; latest $latest verifies"
  else
    echo "attempt $attempt: killed before the first commit"
  fi
done
# The run finishes from the last valid checkpoint.
"${mpirun[@]}" 2 "$bin" train --config "$out/run.toml" --resume auto --train.steps 12 \
  >"$out/log.final" 2>&1 || { cat "$out/log.final"; fail "resume auto failed"; }
grep -q "resume auto: from" "$out/log.final" || { cat "$out/log.final"; fail "did not resume"; }
echo "kill during save: PASS"
