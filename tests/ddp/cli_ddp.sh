#!/usr/bin/env bash
# End to end: `mpirun -np 2 meshtrain train` on the CLI tests' byte corpus.
# Rank 0 alone prints the console lines; every rank writes its metrics;
# the losses equal those of the single-process run of the same config.
# usage: cli_ddp.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
source "$(dirname "$0")/../support/cli_common.sh" "$@"
out=$work/ddp_cli
rm -rf "$out"
args=(train --config "$work/good.toml" --train.steps 6 --train.checkpoint_interval -1
      --train.eval_interval 0 --train.log_interval 1 --train.threads 1)
"$bin" "${args[@]}" --train.out_dir "$out/single" >"$out.single.log" 2>&1 || { cat "$out.single.log"; exit 1; }
"${mpirun[@]}" 2 "$bin" "${args[@]}" --train.out_dir "$out/dp2" >"$out.dp2.log" 2>&1 || { cat "$out.dp2.log"; exit 1; }
cat "$out.dp2.log"
[[ $(grep -c "^step     6/6" "$out.dp2.log") -eq 1 ]] || fail "expected one console line for step 6 (rank 0 only)"
grep -q "^parallel: dp 2 x tp 1 x pp 1 = 2 ranks" "$out.dp2.log" || fail "no parallel: line"
grep -q "dp rank 0 of 2: 1 micro-batches of 4" "$out.dp2.log" || fail "the per-rank split is not printed"
[[ -s $out/dp2/metrics.jsonl && -s $out/dp2/metrics.rank1.jsonl ]] || fail "a rank's metrics file is missing"
python3 - "$out/single/metrics.jsonl" "$out/dp2/metrics.jsonl" "$out/dp2/metrics.rank1.jsonl" <<'PY'
import json, sys
single, rank0, rank1 = ([r for r in map(json.loads, open(p)) if "loss" in r] for p in sys.argv[1:])
assert len(single) == len(rank0) == len(rank1) == 6, (len(single), len(rank0), len(rank1))
for a, b, c in zip(single, rank0, rank1):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
    assert b["loss"] == c["loss"], "ranks disagree on the loss"
    assert b["comm_ms"] > 0 and "exposed_comm_ms" in b
print("losses match the single-process run")
PY

# eval under mpirun: each rank scores its share; the loss is the single-rank one
# and the val_loss the run logged at that step.
"$bin" train --config "$work/good.toml" --train.steps 2 --train.checkpoint_interval 2 --train.eval_interval 2 \
  --train.threads 1 --train.out_dir "$out/eval_run" >"$out.eval_run.log" 2>&1 || { cat "$out.eval_run.log"; exit 1; }
eval_args=(eval --checkpoint "$out/eval_run/step_2" --data "$work/val.bin" --threads 1)
one=$("$bin" "${eval_args[@]}") || fail "eval failed"
two=$("${mpirun[@]}" 2 "$bin" "${eval_args[@]}") || fail "eval under mpirun failed"
echo "$one"; echo "$two"
[[ $(grep -c "^eval " <<<"$two") -eq 1 ]] || fail "expected one eval line (rank 0 only)"
python3 - "$out/eval_run/metrics.jsonl" "$one" "$two" <<'PY'
import json, re, sys
logged = [r["val_loss"] for r in map(json.loads, open(sys.argv[1])) if "val_loss" in r][-1]
one, two = (float(re.search(r"loss ([0-9.]+)", s).group(1)) for s in sys.argv[2:])
assert abs(one - logged) < 1e-5 and abs(two - logged) < 1e-5, (logged, one, two)
print(f"eval: {one} (1 rank) = {two} (2 ranks) = logged val_loss {logged}")
PY
