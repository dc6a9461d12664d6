#!/usr/bin/env bash
# End to end: `mpirun -np 4 meshtrain train --parallel.pp 2` (dp 2 x pp 2)
# and `-np 2 --parallel.pp 2 --parallel.schedule gpipe` on the CLI tests'
# byte corpus: the losses equal the single-process run's, the pipeline line
# is printed once, every rank's metrics carry the bubble.
# usage: cli_pp.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
mpirun=()
while [[ $1 != "--" ]]; do mpirun+=("$1"); shift; done
shift
bin=$1 work=$2
out=$work/pp_cli
rm -rf "$out"
args=(train --config "$work/good.toml" --train.steps 6 --train.checkpoint_interval -1
      --train.eval_interval 3 --train.log_interval 1 --train.threads 1)
"$bin" "${args[@]}" --train.out_dir "$out/single" >"$out.single.log" 2>&1 || { cat "$out.single.log"; exit 1; }
"${mpirun[@]}" 4 "$bin" "${args[@]}" --parallel.pp 2 --train.out_dir "$out/dp2pp2" >"$out.dp2pp2.log" 2>&1 || { cat "$out.dp2pp2.log"; exit 1; }
"${mpirun[@]}" 2 "$bin" "${args[@]}" --parallel.pp 2 --parallel.schedule gpipe --train.out_dir "$out/gpipe" >"$out.gpipe.log" 2>&1 || { cat "$out.gpipe.log"; exit 1; }
cat "$out.dp2pp2.log"
fail() { echo "FAIL: $*"; exit 1; }
grep -q "^parallel: dp 2 x tp 1 x pp 2 = 4 ranks" "$out.dp2pp2.log" || fail "no parallel: line"
[[ $(grep -c "^pipeline: 2 stages x 1 virtual, schedule 1f1b" "$out.dp2pp2.log") -eq 1 ]] || fail "expected one pipeline: line"
python3 - "$out/single/metrics.jsonl" "$out"/dp2pp2/metrics*.jsonl "$out"/gpipe/metrics*.jsonl <<'PY'
import json, sys
single = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
val = [r["val_loss"] for r in map(json.loads, open(sys.argv[1])) if "val_loss" in r]
for path in sys.argv[2:]:
    rows = list(map(json.loads, open(path)))
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 6, (path, len(steps))
    for a, b in zip(single, steps):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (path, a["step"], a["loss"], b["loss"])
        # m = 1 micro-batch per step at dp 2, 2 at dp 1: (p - 1) / m
        assert b["pp_bubble_theory"] == (1.0 if "dp2pp2" in path else 0.5) and b["pp_busy_ms"] > 0, (path, b)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == len(val) and all(abs(x - y) <= 1e-5 * y for x, y in zip(vals, val)), (path, vals, val)
print("losses match the single-process run on every rank")
PY
