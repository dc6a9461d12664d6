#!/usr/bin/env bash
# fp32 vs bf16 vs fp16 (issue 14 item 2; docs/benchmarks.md "Mixed precision").
# 1. Loss curves on real data: configs/llama-tiny-bytes.toml (llama-tiny on
#    byte tokens of the KJV) for STEPS steps in each precision, same seed and
#    data order; the training loss (mean over a 10-step window ending at each
#    mark), the validation loss every 100 steps, fp16's skipped steps and scale.
# 2. Step time on a small model: bench_train_step (forward + backward + AdamW)
#    per precision, alternating A B C A B C (a shared machine drifts), medians.
# usage: bench/precision.sh [steps=300] [rounds=3] [timed steps=3] [threads=2]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-300}; ROUNDS=${2:-3}; TIMED=${3:-3}; THREADS=${4:-2}
BIN=${MESHTRAIN_BIN:-build/meshtrain}
STEP_BIN=${BENCH_BIN:-build/bench/bench_train_step}
[ -x "$BIN" ] && [ -x "$STEP_BIN" ] || { echo "build meshtrain and bench_train_step first" >&2; exit 1; }
work=$(mktemp -d)
if [ -n "${KEEP:-}" ]; then echo "runs in $work" >&2; else trap 'rm -rf "$work"' EXIT; fi

if ! ls data/kjv/bytes/train_*.bin >/dev/null 2>&1; then
  bash scripts/kjv_text.sh data/kjv/text
  "$BIN" prepare --input data/kjv/text --out data/kjv/bytes --tokenizer bytes --val-fraction 0.05
fi
for p in fp32 bf16 fp16; do
  "$BIN" train --config configs/llama-tiny-bytes.toml --train.precision "$p" \
    --train.steps "$STEPS" --train.threads "$THREADS" --train.checkpoint_interval -1 \
    --train.eval_interval 100 --train.log_interval 100 --train.peak_flops 1e11 \
    --train.out_dir "$work/$p" --overwrite >"$work/$p.log"
done
python3 - "$work" "$STEPS" <<'PY'
import json, sys
work, steps = sys.argv[1], int(sys.argv[2])
runs = {}
for p in ("fp32", "bf16", "fp16"):
    lines = [json.loads(l) for l in open(f"{work}/{p}/metrics.jsonl")]
    train = {r["step"]: r for r in lines if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}
    runs[p] = (train, val)
marks = [m for m in (10, 50, 100, 200, 300, 400, 600) if m <= steps]
print("training loss, mean of the 10 steps ending at each step:")
print("| precision | " + " | ".join(f"step {m}" for m in marks) + " | val loss " +
      " | ".join(f"@{s}" for s in sorted(runs["fp32"][1])) + " | skipped steps | final loss scale |")
for p, (train, val) in runs.items():
    window = [sum(train[s]["loss"] for s in range(m - 9, m + 1)) / 10 for m in marks]
    last = train[max(train)]
    print(f"| {p} | " + " | ".join(f"{w:.4f}" for w in window) + " | " +
          " | ".join(f"{val[s]:.4f}" for s in sorted(val)) +
          f" | {last.get('skipped_steps', 0)} | {last.get('loss_scale', 1):g} |")
PY

# Step time: llama, dim 512, 4 layers, 8 heads (4 kv), SwiGLU 1536, vocab 8192,
# 4 sequences of 256.
for round in $(seq "$ROUNDS"); do
  for p in fp32 bf16 fp16; do
    OMP_WAIT_POLICY=passive "$STEP_BIN" --precision "$p" --threads "$THREADS" --steps "$TIMED" \
      --dim 512 --layers 4 --heads 8 --kv-heads 4 --hidden 1536 --vocab 8192 --seq 256 --batch 4 \
      --peak-flops 1e11 >>"$work/step_$p.jsonl"
  done
done
python3 - "$work" <<'PY'
import json, statistics, sys
work = sys.argv[1]
med = {}
for p in ("fp32", "bf16", "fp16"):
    runs = [json.loads(l) for l in open(f"{work}/step_{p}.jsonl")]
    wall = [t for r in runs for t in r["step_ms"]]
    cpu = [t for r in runs for t in r["step_cpu_ms"]]
    med[p] = (statistics.median(wall), statistics.median(cpu), wall)
print("| precision | wall ms (median) | CPU ms (median) | CPU vs bf16 | wall steps |")
for p, (w, c, walls) in med.items():
    print(f"| {p} | {w:.0f} | {c:.0f} | {c / med['bf16'][1]:.2f}x | {[round(t) for t in walls]} |")
PY
