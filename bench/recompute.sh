#!/usr/bin/env bash
# Activation checkpointing (issue 14): llama-60M's shape (dim 512, 8 layers,
# 8 heads, SwiGLU 1536, GPT-2 vocabulary, tied) in bf16 at a sequence where
# activations dominate (default 2048 x 1 sequence), one forward/backward +
# AdamW step per timed step (bench_train_step), for recompute none /
# selective / full / full on N layers. Runs alternate A B C A B C ... (a
# shared machine drifts); per mode the median step over all its runs, the
# MemoryTracker's activation peak, the planner's prediction of it
# (plan::engine_memory) and the theoretical FLOP overhead.
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
    "$BIN" --precision bf16 --threads "$THREADS" --steps "$STEPS" --seq "$SEQ" --batch "$BATCH" \
      --peak-flops 1e11 --recompute "$mode" --recompute-layers "$layers" \
      >>"$out/${mode}_${layers}.jsonl"
  done
done
python3 - "$out" "${MODES[@]}" <<'PY'
import json, statistics, sys
out, modes = sys.argv[1], sys.argv[2:]
rows = {}
for m in modes:
    mode, layers = m.split()
    runs = [json.loads(l) for l in open(f"{out}/{mode}_{layers}.jsonl")]
    steps = [t for r in runs for t in r["step_ms"]]
    rows[m] = (statistics.median(steps), runs[0])
base_ms, base = rows[modes[0]]
print(f"{'mode':<12} {'median ms':>9} {'overhead':>8} {'theory':>7} {'act peak MiB':>12} "
      f"{'planned':>8} {'vs none':>7}  steps ms")
for m in modes:
    ms, r = rows[m]
    steps = [t for l in open(f"{out}/{m.replace(' ', '_')}.jsonl") for t in json.loads(l)["step_ms"]]
    print(f"{m:<12} {ms:9.0f} {100 * (ms / base_ms - 1):7.1f}% {100 * r['flops_overhead_theory']:6.1f}% "
          f"{r['activation_peak_mib']:12.1f} {r['activation_planned_mib']:8.1f} "
          f"{base['activation_peak_mib'] / r['activation_peak_mib']:6.2f}x  {steps}")
PY
