#!/usr/bin/env bash
# Timeline traces end to end on the CLI tests' byte corpus: `meshtrain train
# --train.trace_steps` under dp 2 (a checkpoint in the window), dp 2 x pp 2,
# tp 2, ZeRO 3 with disk offload, and one process with full recompute; each
# run's trace/ (and a resumed run's) is checked by check_trace.py (valid JSON, nesting, every
# collective of the window on every member with the same seq, the merged file).
# usage: cli_trace.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
source "$(dirname "$0")/../support/cli_common.sh" "$@"
here=$(cd "$(dirname "$0")" && pwd)
out=$work/trace_cli
rm -rf "$out"
mkdir -p "$out"
args=(train --config "$work/good.toml" --train.steps 4 --train.checkpoint_interval 0
      --train.eval_interval 0 --train.threads 1)
run() {  # run NAME NP EXTRA... ; then check with the --expect flags in $expect
  local name=$1 np=$2; shift 2
  "${mpirun[@]}" "$np" "$bin" "${args[@]}" --train.out_dir "$out/$name" --train.trace_steps 2-3 "$@" >"$out/$name.log" 2>&1 ||
    { cat "$out/$name.log"; exit 1; }
  python3 "$here/check_trace.py" "$out/$name/trace" "$np" "${expect[@]}"
}
expect=(--expect checkpoint); run dp2 2 --train.checkpoint_interval 3
expect=(--expect pipeline); run dp2pp2 4 --parallel.pp 2
expect=(); run tp2 2 --parallel.tp 2 --parallel.sequence_parallel true
expect=(--expect zero --expect offload); run zero3 2 --parallel.zero 3 --parallel.offload disk \
    --parallel.offload_budget_mb 1
expect=(--expect recompute); run single 1 --train.recompute full --train.trace_steps 3
# A resumed run may change the window (train.trace_steps is free on resume) and traces it.
rm -rf "$out/single/trace"
"$bin" "${args[@]}" --train.out_dir "$out/single" --train.steps 6 --resume auto \
    --train.recompute full --train.trace_steps 5-6 >"$out/resumed.log" 2>&1 || { cat "$out/resumed.log"; exit 1; }
python3 "$here/check_trace.py" "$out/single/trace" 1 --expect recompute
# Off by default: no trace directory.
"$bin" "${args[@]}" --train.out_dir "$out/off" >"$out/off.log" 2>&1 ||
  { cat "$out/off.log"; exit 1; }
[[ ! -e $out/off/trace ]] || { echo "FAIL: a trace without train.trace_steps"; exit 1; }
echo "traces ok"
