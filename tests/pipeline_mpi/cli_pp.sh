#!/usr/bin/env bash
# End to end on the CLI tests' byte corpus: `mpirun -np 4 meshtrain train
# --parallel.pp 2` (dp 2 x pp 2), `-np 2 --parallel.pp 2 --parallel.schedule
# gpipe`, `-np 4 --parallel.tp 2 --parallel.pp 2` (+ sequence parallel) and
# `-np 8` dp 2 x tp 2 x pp 2: the losses equal the single-process run's on
# every rank, the pipeline line is printed once, every rank's metrics carry the
# bubble, and the final checkpoints' weights equal the single run's.
# usage: cli_pp.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
mpirun=()
while [[ $1 != "--" ]]; do mpirun+=("$1"); shift; done
shift
bin=$1 work=$2
out=$work/pp_cli
rm -rf "$out"
args=(train --config "$work/good.toml" --train.steps 6 --train.checkpoint_interval 0
      --train.eval_interval 3 --train.log_interval 1 --train.threads 1)
"$bin" "${args[@]}" --train.out_dir "$out/single" >"$out.single.log" 2>&1 || { cat "$out.single.log"; exit 1; }
"${mpirun[@]}" 4 "$bin" "${args[@]}" --parallel.pp 2 --train.out_dir "$out/dp2pp2" >"$out.dp2pp2.log" 2>&1 || { "${mpirun[@]}" 4 "$bin" "${args[@]}" --parallel.pp 2 --parallel.tp 2 --parallel.sequence_parallel true --train.out_dir "$out/tp2pp2" >"$out.tp2pp2.log" 2>&1 || { cat "$out.tp2pp2.log"; exit 1; }
"${mpirun[@]}" 8 "$bin" "${args[@]}" --parallel.pp 2 --parallel.tp 2 --train.out_dir "$out/dp2tp2pp2" >"$out.dp2tp2pp2.log" 2>&1 || { cat "$out.dp2tp2pp2.log"; exit 1; }
cat "$out.dp2pp2.log"; exit 1; }
"${mpirun[@]}" 2 "$bin" "${args[@]}" --parallel.pp 2 --parallel.schedule gpipe --train.out_dir "$out/gpipe" >"$out.gpipe.log" 2>&1 || { cat "$out.gpipe.log"; exit 1; }
"${mpirun[@]}" 4 "$bin" "${args[@]}" --parallel.pp 2 --parallel.tp 2 --parallel.sequence_parallel true --train.out_dir "$out/tp2pp2" >"$out.tp2pp2.log" 2>&1 || { cat "$out.tp2pp2.log"; exit 1; }
"${mpirun[@]}" 8 "$bin" "${args[@]}" --parallel.pp 2 --parallel.tp 2 --train.out_dir "$out/dp2tp2pp2" >"$out.dp2tp2pp2.log" 2>&1 || { cat "$out.dp2tp2pp2.log"; exit 1; }
cat "$out.dp2pp2.log"
fail() { echo "FAIL: $*"; exit 1; }
grep -q "^parallel: dp 2 x tp 1 x pp 2 = 4 ranks" "$out.dp2pp2.log" || fail "no parallel: line"
[[ $(grep -c "^pipeline: 2 stages x 1 virtual, schedule 1f1b" "$out.dp2pp2.log") -eq 1 ]] || fail "expected one pipeline: line"
python3 - "$out/single/metrics.jsonl" "$out"/{dp2pp2,gpipe,tp2pp2,dp2tp2pp2}/metrics*.jsonl <<'PY'
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
        assert b["pp_bubble_theory"] == (1.0 if "/dp2" in path else 0.5) and b["pp_busy_ms"] > 0, (path, b)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == len(val) and all(abs(x - y) <= 1e-5 * y for x, y in zip(vals, val)), (path, vals, val)
print("losses match the single-process run on every rank")
PY
# Each layout's sharded checkpoint exported whole (HF names and layout).
for run in single dp2pp2 gpipe tp2pp2 dp2tp2pp2; do
  "$bin" ckpt export --format hf --checkpoint "$out/$run/step_6" --out "$out/hf_$run" >/dev/null
done
python3 - "$out"/hf_{single,dp2pp2,gpipe,tp2pp2,dp2tp2pp2}/model.safetensors <<'PY'
import json, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (path, name, t["dtype"])
        a, b = t["data_offsets"]
        out[name] = struct.unpack(f"<{(b - a) // 4}f", data[8 + n + a:8 + n + b])
    return out
ref = tensors(sys.argv[1])
for path in sys.argv[2:]:
    got = tensors(path)
    assert got.keys() == ref.keys(), (path, sorted(set(got) ^ set(ref)))
    for name, want in ref.items():
        scale = max(max(abs(x) for x in want), 1e-30)
        diff = max(abs(x - y) for x, y in zip(got[name], want))
        assert diff <= 1e-4 * scale, (path, name, diff, scale)
print("exported weights equal the single run's in every layout")
PY
