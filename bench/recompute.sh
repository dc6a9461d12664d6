#!/usr/bin/env bash
# Activation checkpointing (issue 14): llama-60M's shape (dim 512, 8 layers,
# 8 heads, SwiGLU 1536, GPT-2 vocabulary, tied) in bf16 at a sequence where
# activations dominate (default 2048 x 1 sequence), one forward/backward +
# AdamW step per timed step (bench_train_step), for recompute none /
# selective / full / full on N layers. Runs alternate A B C A B C ... (a
# shared machine drifts); per mode the median step over all its runs, the
# MemoryTracker's activation peak, the planner's prediction of it
# (plan::engine_memory) and the theoretical FLOP overhead. Step times: wall
# and process CPU time (OMP_WAIT_POLICY=passive, so spinning threads do not
# count), medians over every timed step of every run.
# usage: bench/recompute.sh [rounds=2] [steps=3] [seq=2048] [batch=1] [threads=2]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}; STEPS=${2:-3}; SEQ=${3:-2048}; BATCH=${4:-1}; THREADS=${5:-2}
BIN=${BENCH_BIN:-build/bench/bench_train_step}
MODES=("none 0" "selective 0" "full 0" "full 4")
out=$(mktemp -d)
for round in $(seq "$ROUNDS"); do
  for m in "${MODES[@]}"; do
    read -r mode layers <<<"$m"
    OMP_WAIT_POLICY=passive "$BIN" --precision bf16 --threads "$THREADS" --steps "$STEPS" --seq "$SEQ" --batch "$BATCH" \
      --peak-flops 1e11 --recompute "$mode" --recompute-layers "$layers" \
      >>"$out/${mode}_${layers}.jsonl"
  done
done
python3 - "$out" "${MODES[@]}" <<'PY'
import json, statistics, sys
out, modes = sys.argv[1], sys.argv[2:]
rows = {}
for m in modes:
    runs = [json.loads(l) for l in open(f"{out}/{m.replace(' ', '_')}.jsonl")]
    wall = [t for r in runs for t in r["step_ms"]]
    cpu = [t for r in runs for t in r["step_cpu_ms"]]
    rows[m] = (statistics.median(wall), statistics.median(cpu), wall, cpu, runs[0])
base = rows[modes[0]]
print(f"{'mode':<12} {'wall ms':>8} {'+wall':>6} {'cpu ms':>8} {'+cpu':>6} {'theory':>7} "
      f"{'act peak MiB':>12} {'planned':>8} {'vs none':>7}  wall steps / cpu steps")
for m in modes:
    wall, cpu, walls, cpus, r = rows[m]
    print(f"{m:<12} {wall:8.0f} {100 * (wall / base[0] - 1):5.1f}% {cpu:8.0f} "
          f"{100 * (cpu / base[1] - 1):5.1f}% {100 * r['flops_overhead_theory']:6.1f}% "
          f"{r['activation_peak_mib']:12.1f} {r['activation_planned_mib']:8.1f} "
          f"{base[4]['activation_peak_mib'] / r['activation_peak_mib']:6.2f}x  "
          f"{[round(t) for t in walls]} / {[round(t) for t in cpus]}")
PY
