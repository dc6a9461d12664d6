#!/usr/bin/env bash
# dp 2 x pp 2 (4 ranks) across two namespace hosts, 2 ranks each (pipeline stage 0 on
# host A, stage 1 on host B: activations and the tied-embedding sum cross the link,
# each stage's DDP all-reduce stays on its host), equals the same run on one host bit
# for bit: every rank's losses, gradient norms and validation losses, and every rank's
# checkpoint shard (weights and optimizer state).
# usage: dp2pp2.sh MESHTRAIN CLI_WORK_DIR (the CLI tests' inputs: tests/cli/make_inputs.sh)
set -uo pipefail
source "$(dirname "$0")/bed.sh"
bin=$1 inputs=$2
work=$inputs/multinode_dp2pp2
rm -rf "$work"
fail() { echo "FAIL: $*"; exit 1; }
bed_up "$work"
args=(train --config "$inputs/good.toml" --train.steps 6 --train.checkpoint_interval 0
      --train.eval_interval 3 --train.log_interval 1 --train.threads 1 --parallel.pp 2)
timeout 120 mpirun --allow-run-as-root --oversubscribe -np 4 "$bin" "${args[@]}" \
  --train.out_dir "$work/one_host" >"$work/one_host.log" 2>&1 || { cat "$work/one_host.log"; fail "one-host run"; }
t0=$(date +%s.%N)
bed_mpirun 4 "$bin" "${args[@]}" --train.out_dir "$work/two_hosts" >"$work/two_hosts.log" 2>&1 ||
  { cat "$work/two_hosts.log"; fail "two-host run"; }
t1=$(date +%s.%N)
grep -q "^parallel: dp 2 x tp 1 x pp 2 = 4 ranks" "$work/two_hosts.log" || { cat "$work/two_hosts.log"; fail "no parallel: line"; }
echo "two-host run: $(echo "$t1 - $t0" | bc) s"
python3 "$(dirname "$0")/../support/compare_runs.py" 4 6 "$work/one_host" "$work/two_hosts" ||
  fail "the two-host run differs from the one-host run"
# Nothing left on either host.
for h in "$BED_A" "$BED_B"; do
  [ -z "$(bed_pids "$h")" ] || fail "processes left on $h: $(bed_pids "$h")"
done
echo "multinode dp2pp2: PASS"
