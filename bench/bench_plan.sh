#!/usr/bin/env bash
# Times `meshtrain plan` end to end (process start, search, output) at 1 to 16,384 GPUs and
# prints the planner's own search time. usage: bench/bench_plan.sh [build-dir]
set -euo pipefail
bin=${1:-build}/meshtrain
for gpus in 8 1024 16384; do
  for model in llama3-8b llama3-70b llama3-405b; do
    start=$(date +%s.%N)
    line=$("$bin" plan --model "$model" --gpus "$gpus" --seq 8192 --global-batch-tokens 16M \
           --tokens 15T 2>/dev/null | grep '^search' || true)
    end=$(date +%s.%N)
    printf '%-12s %6d GPUs  wall %6.3f s  %s\n' "$model" "$gpus" "$(echo "$end - $start" | bc)" \
      "${line:-(nothing fits)}"
  done
done
