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
python3 - "$work/one_host" "$work/two_hosts" <<'PY'
import glob, json, os, sys
one, two = sys.argv[1:]
def trace(run):
    out = {}
    for path in sorted(glob.glob(f"{run}/metrics*.jsonl")):
        rows = [json.loads(l) for l in open(path)]
        out[os.path.basename(path)] = [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss"))
                                       for r in rows if "loss" in r or "val_loss" in r]
    return out
a, b = trace(one), trace(two)
assert len(a) == 4 and a.keys() == b.keys(), (sorted(a), sorted(b))
for name in a:
    assert len([r for r in a[name] if r[1] is not None]) == 6, (name, a[name])
    assert a[name] == b[name], (name, a[name], b[name])
print("losses, gradient norms and validation losses equal the one-host run's on every rank")
PY
[ $? -eq 0 ] || fail "traces differ"
for f in "$work"/one_host/step_6/rank_*.safetensors; do
  cmp -s "$f" "$work/two_hosts/step_6/$(basename "$f")" || fail "$(basename "$f") differs from the one-host run's"
done
[ "$(ls "$work"/two_hosts/step_6/rank_*.safetensors | wc -l)" -eq 4 ] || fail "expected 4 shards"
echo "final checkpoint shards equal the one-host run's byte for byte"
# Nothing left on either host.
for h in "$BED_A" "$BED_B"; do
  [ -z "$(bed_pids "$h")" ] || fail "processes left on $h: $(bed_pids "$h")"
done
echo "multinode dp2pp2: PASS"
