#!/usr/bin/env bash
# A rank slower than rank 0's commit: rank 1 pauses between writing its done
# file and syncing the save's directory, so rank 0 commits and renames the
# directory first. The save is done: rank 1 must go on (it once waited for the
# gone directory until its 600 s commit timeout, holding the job in the next
# barrier; launch.one_run met it by chance). Run with comm deadlines of 20 s,
# a hang fails the job instead of the test's timeout.
# usage: commit_before_sync.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/../support/cli_common.sh"
out="$work/commit_before_sync"
rm -rf "$out" && mkdir -p "$out"
python3 "$(dirname "$0")/../support/random_tokens.py" "$out/train.bin" 50000 256 5
cat >"$out/run.toml" <<TOML
[model]
preset = "llama-tiny"
[train]
steps = 9
batch_size = 4
seq_len = 32
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = 3
out_dir = "$out/run"
[comm]
timeout_s = 20
long_timeout_s = 20
[data]
tokenizer = "bytes"
train = "$out/train.bin"
TOML
cat >"$out/slow_rank1.sh" <<'SH'
#!/usr/bin/env bash
[[ ${OMPI_COMM_WORLD_RANK:-0} == 1 ]] && export MESHTRAIN_CKPT_FAULT=after_done@6:pause=2
exec "$@"
SH
chmod +x "$out/slow_rank1.sh"
start=$SECONDS
"${mpirun[@]}" 2 "$out/slow_rank1.sh" "$bin" train --config "$out/run.toml" >"$out/run.log" 2>&1 ||
  { tail -20 "$out/run.log"; fail "the job failed"; }
echo "9 steps with rank 1 paused 2 s after its step-6 done file: $((SECONDS - start)) s"
"$bin" ckpt inspect --verify "$out/run/step_6" >/dev/null || fail "step_6 does not verify"
"$bin" ckpt inspect --verify "$out/run/step_9" >/dev/null || fail "step_9 does not verify"
echo "commit before sync: PASS"
