#!/usr/bin/env bash
# Step time of two meshtrain binaries (before / after a change) on llama-60M,
# alternating A B A B, single rank (2 threads) and dp 2 (1 thread per rank):
# the median step time of steps 3.. of each run, per round, and the B/A ratio.
# usage: bench/ab_binaries.sh BIN_A BIN_B [ROUNDS=3] [STEPS=6]
set -euo pipefail
A=$1 B=$2 ROUNDS=${3:-3} STEPS=${4:-6}
MESHTRAIN_BIN=$A source "$(dirname "$0")/common.sh"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
random_tokens 2000000
write_run_config <<TOML
steps = $STEPS
batch_size = 4
micro_batch_size = 4
TOML
median_ms() {  # median step_ms of steps >= 3 in a metrics file
  python3 - "$1" <<'PY'
import json, statistics, sys
ms = [r["step_ms"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r and r["step"] >= 3]
print(f"{statistics.median(ms):.1f}")
PY
}
for layout in single dp2; do
  for round in $(seq "$ROUNDS"); do
    for side in A B; do
      bin=$A; [ "$side" = B ] && bin=$B
      out="$work/$layout.$side.$round"
      if [ "$layout" = single ]; then
        OMP_NUM_THREADS=2 "$bin" train --config "$work/run.toml" --train.threads 2 --train.out_dir "$out" >/dev/null
      else
        "${MPIRUN[@]}" -np 2 "$bin" train --config "$work/run.toml" --train.out_dir "$out" >/dev/null
      fi
      eval "ms_$side=$(median_ms "$out/metrics.jsonl")"
    done
    echo "{\"layout\": \"$layout\", \"round\": $round, \"a_ms\": $ms_A, \"b_ms\": $ms_B, \"b_over_a\": $(python3 -c "print(round($ms_B / $ms_A, 4))")}"
  done
done
