#!/usr/bin/env bash
# End to end: `mpirun -np 2 meshtrain train --parallel.zero 3` (and disk
# offload: stage 2's optimizer state, stage 3's parameters too) on the CLI
# tests' byte corpus: the losses equal the single-process
# run's, rank 0 prints the ZeRO line and the memory reports, the checkpoint
# rank 0 writes resumes in a single process, the offload files are gone.
# usage: cli_zero.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
source "$(dirname "$0")/../support/cli_common.sh" "$@"
out=$work/zero_cli
rm -rf "$out" && mkdir -p "$out"
args=(train --config "$work/good.toml" --train.steps 6 --train.checkpoint_interval 3
      --train.eval_interval 0 --train.log_interval 1 --train.threads 1)
run() {  # name, command...
  local name=$1; shift
  "$@" --train.out_dir "$out/$name" >"$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
}
run single "$bin" "${args[@]}"
run zero3 "${mpirun[@]}" 2 "$bin" "${args[@]}" --parallel.zero 3
run disk "${mpirun[@]}" 2 "$bin" "${args[@]}" --parallel.zero 2 --parallel.offload disk \
    --parallel.offload_budget_mb 1
run disk3 "${mpirun[@]}" 2 "$bin" "${args[@]}" --parallel.zero 3 --parallel.offload disk \
    --parallel.offload_budget_mb 1
run resumed "$bin" "${args[@]}" --resume "$out/zero3/step_3"
cat "$out/zero3.log"
grep -q "^parallel: dp 2 x tp 1 x pp 1 = 2 ranks.*ZeRO stage 3: .*prefetch on" "$out/zero3.log" ||
  fail "no ZeRO parallel: line"
grep -q "optimizer state offloaded to disk (resident budget 1.00 MiB)" "$out/disk.log" ||
  fail "no offload in the parallel: line"
grep -q "parameters and optimizer state offloaded to disk (resident budget 1.00 MiB)" \
  "$out/disk3.log" || fail "no parameter offload in the parallel: line"
grep -q "^memory at end, max over 2 ranks: " "$out/zero3.log" || fail "no memory report"
[[ $(grep -c "^step     6/6" "$out/zero3.log") -eq 1 ]] || fail "expected one console line for step 6"
[[ -z $(ls -A "$out/disk/offload") && -z $(ls -A "$out/disk3/offload") ]] ||
  fail "offload files left behind"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def steps(name, rank=""):
    return [r for r in map(json.loads, open(f"{out}/{name}/metrics{rank}.jsonl")) if "loss" in r]
single = steps("single")
for name in ("zero3", "disk", "disk3"):
    rank0, rank1 = steps(name), steps(name, ".rank1")
    assert len(rank0) == len(rank1) == len(single) == 6
    for a, b, c in zip(single, rank0, rank1):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, a["step"], a["loss"], b["loss"])
        assert b["loss"] == c["loss"], "ranks disagree on the loss"
        assert b["comm_bytes"] > 0
        assert (b.get("offload_read_bytes", 0) > 0) == name.startswith("disk"), (name, b)
# The single-process resume from the ZeRO checkpoint continues the run.
resumed = steps("resumed")
assert [r["step"] for r in resumed] == [4, 5, 6], resumed
for a, b in zip(single[3:], resumed):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
print("zero 3 and disk offload (stage 2, stage 3 with parameters) match the single-process run; its checkpoint resumes in one process")
PY
