#!/usr/bin/env bash
# Predicted next to measured memory (issue 14): llama-60M in bf16 (batch 4,
# micro-batch 1, seq 256, 2 steps) in several layouts under mpirun; per rank
# and category the MemoryTracker's peak from the run's end record in its
# metrics file and the prediction the run printed next to it
# (train/memory_plan.h; `meshtrain plan --config` prints the same numbers).
# usage: bench/memory_plan.sh [recompute=selective]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
RECOMPUTE=${1:-selective}
random_tokens 40000
LAYOUTS=("single|1|" "dp 2 ZeRO-3|2|--parallel.zero 3" "tp 2 + SP|2|--parallel.tp 2 --parallel.sequence_parallel true"
         "pp 2 1F1B|2|--parallel.pp 2" "dp2 x tp2 x pp2|8|--parallel.tp 2 --parallel.pp 2 --parallel.sequence_parallel true")
write_run_config <<TOML
precision = "bf16"
steps = 2
batch_size = 4
micro_batch_size = 1
recompute = "$RECOMPUTE"
TOML
i=0
for layout in "${LAYOUTS[@]}"; do
  IFS='|' read -r name ranks args <<<"$layout"
  i=$((i + 1))
  # shellcheck disable=SC2086
  "${MPIRUN[@]}" -np "$ranks" "$BIN" train --config "$work/run.toml" --train.out_dir "$work/run$i" \
    --train.log_interval 100 $args >"$work/run$i.log"
  echo "$name" >"$work/run$i.name"
done
python3 - "$work" "$i" <<'PY'
import glob, json, sys
work, n = sys.argv[1], int(sys.argv[2])
cats = ["params", "grads", "optimizer", "activations", "workspace", "comm"]
mib = lambda b: b / 2**20
print(f"{'layout':<16} {'rank':>4} " + " ".join(f"{c:>17}" for c in cats) + "   (MiB measured / predicted)")
for i in range(1, n + 1):
    name = open(f"{work}/run{i}.name").read().strip()
    files = sorted(glob.glob(f"{work}/run{i}/metrics*.jsonl"))
    rows = []
    for f in files:
        end = [json.loads(l) for l in open(f) if '"memory":"end"' in l][-1]
        rows.append(end)
    rows.sort(key=lambda r: r["rank"])
    for r in rows:
        cells = []
        for c in cats:
            got, want = r["bytes"][c + "_peak"], r["predicted"][c]
            mark = "" if r["basis"][c] == "exact" else "b"
            cells.append(f"{mib(got):7.2f}/{mib(want):7.2f}{mark:1}")
        print(f"{name:<16} {r['rank']:>4} " + " ".join(f"{c:>17}" for c in cells))
print("b: a bound (timing-dependent peak); others exact")
PY
