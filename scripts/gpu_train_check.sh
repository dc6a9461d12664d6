#!/usr/bin/env bash
# gpu_check.sh's training runs, with the engine's bundle (scripts/gpu_bundle.sh):
#   - a small Llama and a small GPT-2 (configs/gpu-check-*.toml), 20 steps in
#     fp32 and in bf16, once on device A and once on device B; the losses must
#     agree within fp32: 1e-4 relative, bf16: 1e-2 relative at every step, and
#     the gradient norms as closely over steps 1-5 (AdamW divides a gradient by
#     its own scale, so a gradient off by a constant factor shows in the norms,
#     hardly in the losses; later norms follow the trajectory, which AdamW
#     amplifies: two summation orders on one CPU part by 32% in a norm near a
#     loss spike while their losses stay within 2e-3, docs/gpu.md);
#   - with B = cuda, the GPT-2 124M step (configs/gpu-check-gpt2-124M.toml):
#     tokens/s and MFU over its steps after the second.
# Prints one "ROW|check|result|detail" line per check for gpu_check.sh's table.
# usage: bash scripts/gpu_train_check.sh OUT [A B]   (default A = cpu, B = cuda;
# "cpu cpu" runs B in micro-batches of 4 instead of 8, another summation order
# on one backend: the margin the tolerances leave, on a machine without a GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
a=${2:-cpu} b=${3:-cuda}
mt=build/gpu-bundle/meshtrain
if [[ ! -x $mt && -f build/gpu-bundle.tar.xz ]]; then tar -xJf build/gpu-bundle.tar.xz -C build; fi
if [[ ! -x $mt ]]; then
  echo "ROW|train 20 steps $a vs $b|SKIPPED|no engine bundle carried (scripts/gpu_bundle.sh makes build/gpu-bundle.tar.xz)"
  exit 0
fi
runs=build/gpu-check-runs
rm -rf "$runs"

train() {  # name config device precision [overrides...]
  local name=$1 config=$2 device=$3 precision=$4; shift 4
  timeout 240 "$mt" train --config "$config" --train.device "$device" \
    --train.precision "$precision" --train.out_dir "$runs/$name" "$@" > "$out/train_$name.txt" 2>&1
}

# The largest relative loss and gradient-norm differences of two runs'
# metrics, or why there are none.
compare() {  # dir_a dir_b tolerance
  python3 - "$@" <<'EOF'
import json, sys

def trace(run):
    rows = (json.loads(line) for line in open(run + "/metrics.jsonl"))
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows
            if "loss" in r and "grad_norm" in r and "memory" not in r}

try:
    a, b = trace(sys.argv[1]), trace(sys.argv[2])
except OSError as e:
    print(f"FAIL|no metrics: {e}")
    sys.exit(0)
tolerance = float(sys.argv[3])
if sorted(a) != sorted(b) or len(a) < 20:
    print(f"FAIL|steps differ: {len(a)} and {len(b)} logged")
    sys.exit(0)
loss = max(abs(a[s][0] - b[s][0]) / abs(a[s][0]) for s in a)
norm = max(abs(a[s][1] - b[s][1]) / abs(a[s][1]) for s in a if s <= 5)
last = max(a)
verdict = "PASS" if max(loss, norm) <= tolerance else "FAIL"
print(f"{verdict}|max relative difference over {len(a)} steps: loss {loss:.1e}, gradient norm "
      f"{norm:.1e} over steps 1-5 (tolerance {tolerance:g}); loss {a[1][0]:.4f} -> {a[last][0]:.4f} / "
      f"{b[last][0]:.4f}")
EOF
}

reorder=()
[[ $a == "$b" ]] && reorder=(--train.micro_batch_size 4)
for family in llama gpt2; do
  for precision in fp32 bf16; do
    tolerance=$([[ $precision == fp32 ]] && echo 1e-4 || echo 1e-2)
    train "$family-$precision-A" "configs/gpu-check-$family.toml" "$a" "$precision"
    train "$family-$precision-B" "configs/gpu-check-$family.toml" "$b" "$precision" "${reorder[@]}"
    result=$(compare "$runs/$family-$precision-A" "$runs/$family-$precision-B" "$tolerance")
    if [[ $result == FAIL\|no\ metrics* ]]; then
      result="FAIL|$(tail -1 "$out/train_$family-$precision-B.txt")"
    fi
    echo "ROW|train $family 20 steps $precision, $a vs $b${reorder[*]:+ (${reorder[*]})}|$result"
  done
done

if [[ $b != cuda ]]; then
  echo "ROW|GPT-2 124M training step|SKIPPED|times the cuda device only"
  exit 0
fi
train gpt2-124M configs/gpu-check-gpt2-124M.toml cuda bf16
python3 - "$runs/gpt2-124M" "$out/train_gpt2-124M.txt" <<'EOF'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
except OSError:
    lines = open(sys.argv[2]).read().strip().splitlines() or ["no output"]
    print(f"ROW|GPT-2 124M training step|FAIL|{lines[-1]}")
    sys.exit(0)
steps = [r for r in rows if "tokens_per_s" in r and r["step"] > 2]
if not steps:
    print("ROW|GPT-2 124M training step|FAIL|fewer than 3 steps ran")
    sys.exit(0)
tps = sum(r["tokens_per_s"] for r in steps) / len(steps)
mfu = sum(r["mfu"] for r in steps) / len(steps)
ms = sum(r["step_ms"] for r in steps) / len(steps)
print(f"ROW|GPT-2 124M training step|{tps:,.0f} tokens/s|MFU {100 * mfu:.1f}% of 989 TFLOP/s "
      f"(6N + attention FLOPs per token), {ms:.1f} ms per 8x1024 step, bf16; goal >= 400K tokens/s")
EOF
