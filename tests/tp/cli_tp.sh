#!/usr/bin/env bash
# End to end: `mpirun -np 2 meshtrain train --parallel.tp 2` (with and without
# sequence parallelism; and tp 2 x dp 2 with ZeRO 3 on 4 ranks) on the CLI
# tests' byte corpus matches the single-process losses; checkpoints resume
# across tp 1 <-> 2 (and from tp 2 x ZeRO 3); and the HF
# export of an untrained checkpoint is the same file whatever tp wrote it.
# usage: cli_tp.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
source "$(dirname "$0")/../support/cli_common.sh" "$@"
out=$work/tp_cli
rm -rf "$out" && mkdir -p "$out"
args=(train --config "$work/good.toml" --train.steps 6 --train.eval_interval 0
      --train.log_interval 1 --train.threads 1)
run() {  # run NAME RANKS ARGS...
  local name=$1 ranks=$2
  shift 2
  local cmd=("$bin" "${args[@]}" --train.out_dir "$out/$name" "$@")
  [[ $ranks -gt 1 ]] && cmd=("${mpirun[@]}" "$ranks" "${cmd[@]}")
  "${cmd[@]}" >"$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
}
run single 1 --train.checkpoint_interval 3 --train.eval_interval 3
run tp2 2 --parallel.tp 2 --train.checkpoint_interval 3
run tp2sp 2 --parallel.tp 2 --parallel.sequence_parallel true --train.checkpoint_interval -1 \
  --train.eval_interval 3
run resume_tp1_from_tp2 1 --resume "$out/tp2/step_3" --train.checkpoint_interval -1
run resume_tp2_from_tp1 2 --parallel.tp 2 --resume "$out/single/step_3" --train.checkpoint_interval -1
# tp 2 x dp 2 with ZeRO 3 on the dp axis; its checkpoint resumes a single process.
run tp2dp2z3 4 --parallel.tp 2 --parallel.zero 3 --train.checkpoint_interval 3
run resume_tp1_from_tp2dp2z3 1 --resume "$out/tp2dp2z3/step_3" --train.checkpoint_interval -1
cat "$out/tp2sp.log"
grep -q "^parallel: dp 1 x tp 2 x pp 1 = 2 ranks" "$out/tp2.log" || fail "no parallel: line"
grep -q "^tensor parallel: tp 2, sequence parallel on" "$out/tp2sp.log" || fail "no tensor parallel: line"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def losses(path):
    return {r["step"]: r for r in map(json.loads, open(path)) if "loss" in r}
single = losses(f"{out}/single/metrics.jsonl")
for name, first in [("tp2", 1), ("tp2sp", 1), ("resume_tp1_from_tp2", 4), ("resume_tp2_from_tp1", 4),
                    ("tp2dp2z3", 1), ("resume_tp1_from_tp2dp2z3", 4)]:
    got = losses(f"{out}/{name}/metrics.jsonl")
    assert sorted(got) == list(range(first, 7)), (name, sorted(got))
    for step, r in got.items():
        a, b = single[step]["loss"], r["loss"]
        assert abs(a - b) <= 1e-5 * abs(a), (name, step, a, b)
    if name.startswith("tp2"):
        rank1 = losses(f"{out}/{name}/metrics.rank1.jsonl")
        assert all(rank1[s]["loss"] == got[s]["loss"] for s in got), f"{name}: tp ranks disagree"
        assert all(r["tp_comm_bytes"] > 0 for r in got.values()), f"{name}: no tp bytes"
def val_losses(path):
    return {r["step"]: r["val_loss"] for r in map(json.loads, open(path)) if "val_loss" in r}
want, got = val_losses(f"{out}/single/metrics.jsonl"), val_losses(f"{out}/tp2sp/metrics.jsonl")
assert sorted(want) == sorted(got) == [3, 6], (want, got)
assert all(abs(want[s] - got[s]) <= 1e-5 * want[s] for s in want), (want, got)
print("tp losses, validation losses and resumes across tp 1 <-> 2 match the single-process run")
PY
# Untrained weights (lr 1e-30 leaves every f32 weight as initialised): the
# exported model is the same file from tp 1 and tp 2.
args=(train --config "$work/good.toml" --train.steps 1 --train.eval_interval 0 --train.threads 1
      --optim.lr 1e-30 --optim.min_lr 0 --train.checkpoint_interval 1)
run init_tp1 1
run init_tp2 2 --parallel.tp 2
"$bin" ckpt export --format hf --checkpoint "$out/init_tp1/step_1" --out "$out/hf_tp1" >/dev/null
"$bin" ckpt export --format hf --checkpoint "$out/init_tp2/step_1" --out "$out/hf_tp2" >/dev/null
cmp "$out/hf_tp1/model.safetensors" "$out/hf_tp2/model.safetensors" || fail "exports differ"
echo "the HF export is the same file at tp 1 and tp 2"
