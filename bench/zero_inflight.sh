#!/usr/bin/env bash
# The ZeRO reduce-scatter rate limiter (parallel.max_inflight_reduces, issue
# 14): step time and gradient peak at K = 2 (the default) against K = 64 (as
# good as unlimited: every flat parameter's call of a step may be in flight),
# dp 2, ZeRO-2 and ZeRO-3, a small llama (dim 256, 4 layers, GPT-2 vocab) in
# bf16, seq 128, 4 micro-batches of 1 per rank per step, 1 thread per rank.
# Runs A B A B (ROUNDS rounds) so that the shared machine's load falls on both;
# step time: the slower rank's, median and best of the timed steps over all
# rounds (the first step is warm-up).
# usage: bench/zero_inflight.sh [steps=4] [rounds=2]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-4}
ROUNDS=${2:-2}
source bench/common.sh
random_tokens 200000
cat >"$work/run.toml" <<TOML
[model]
family = "llama"
dim = 256
n_layers = 4
n_heads = 4
n_kv_heads = 2
hidden_dim = 688
vocab_size = 50257
max_seq_len = 128
[train]
precision = "bf16"
seq_len = 128
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
steps = $((STEPS + 1))
batch_size = 8
micro_batch_size = 1
log_interval = 1
[data]
train = "$work/train.bin"
TOML
for ((r = 1; r <= ROUNDS; r++)); do
  for zero in 2 3; do
    for k in 2 64; do
      "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" --train.out_dir "$work/z${zero}k$k.$r" \
        --parallel.zero "$zero" --parallel.max_inflight_reduces "$k" >"$work/z${zero}k$k.$r.log"
    done
  done
done
python3 - "$work" <<'PY'
import glob, json, statistics, sys
work = sys.argv[1]
print(f"{'run':22} {'median ms':>9} {'best ms':>8} {'exposed ms':>10} {'grads peak MiB':>14} {'predicted':>10}")
for zero in (2, 3):
    for k in (2, 64):
        steps, exposed, grads, want = [], [], 0, 0
        for run in sorted(glob.glob(f"{work}/z{zero}k{k}.*[0-9]")):
            ranks = [list(map(json.loads, open(p))) for p in sorted(glob.glob(f"{run}/metrics*.jsonl"))]
            timed = [[r for r in rows if "step_ms" in r][1:] for rows in ranks]
            for i in range(len(timed[0])):
                steps.append(max(t[i]["step_ms"] for t in timed))
                exposed.append(max(t[i]["exposed_comm_ms"] for t in timed))
            for rows in ranks:
                end = [r for r in rows if r.get("memory") == "end"][0]
                grads = max(grads, end["bytes"]["grads_peak"])
                want = max(want, end["predicted"]["grads"])
        print(f"ZeRO-{zero} K={k:<13} {statistics.median(steps):9.0f} {min(steps):8.0f} "
              f"{statistics.median(exposed):10.0f} {grads / 2**20:14.2f} {want / 2**20:10.2f}")
PY
