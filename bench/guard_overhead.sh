#!/usr/bin/env bash
# The stability guard's and the straggler hook's cost per step (issue 15;
# docs/benchmarks.md "Stability guard and stragglers"). fp32, so the guard's
# vote is the only gate collective (one all-reduce of one int64 over the
# world per step). dp 2 under mpirun, 1 thread per rank, a small llama (dim
# 256, 4 layers, vocab 8192, sequence 128, 4 sequences per rank) on random
# tokens below 8192. Configurations, interleaved A B C A B C (the machine is shared):
#   off:        guard.enabled = false (no gate: no collective)
#   guard:      the default guard, with spike detection on (loss_z = grad_z = 6)
#   stragglers: guard off, train.straggler_interval = 1 (the gather every step: the worst case)
# Per configuration: the median step time over the timed steps of every round
# (rank 0's records, the first step dropped), the median gates_ms (the votes
# and the collective as measured inside the step: an upper bound, it also
# absorbs the ranks' skew that a later collective would otherwise wait for)
# and, for stragglers, the median report_ms (the hook's gather and analysis,
# which run after the step and are not in step_ms).
# usage: bench/guard_overhead.sh [steps=20] [rounds=3]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}
ROUNDS=${2:-3}
source bench/common.sh
random_tokens 200000 8192
cat >"$work/run.toml" <<TOML
[model]
family = "llama"
dim = 256
n_layers = 4
n_heads = 8
n_kv_heads = 4
hidden_dim = 768
vocab_size = 8192
max_seq_len = 128
[train]
steps = $((STEPS + 1))
batch_size = 8
seq_len = 128
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
log_interval = 1000
[data]
train = "$work/train.bin"
TOML
run() {  # name round overrides...
  local name=$1 round=$2; shift 2
  "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" --train.out_dir "$work/$name.$round" \
    "$@" >"$work/$name.$round.log"
}
for round in $(seq "$ROUNDS"); do
  run off "$round" --guard.enabled false
  run guard "$round" --guard.loss_z 6 --guard.grad_z 6 --guard.min_steps 5
  run stragglers "$round" --guard.enabled false --train.straggler_interval 1
done
python3 - "$work" "$ROUNDS" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def steps(name):
    out = []
    for r in range(1, rounds + 1):
        recs = [json.loads(l) for l in open(f"{work}/{name}.{r}/metrics.jsonl")]
        out += [x for x in recs if "loss" in x and x["step"] > 1]
    return out
def reports(name):
    out = []
    for r in range(1, rounds + 1):
        recs = [json.loads(l) for l in open(f"{work}/{name}.{r}/metrics.jsonl")]
        out += [x["report_ms"] for x in recs if x.get("event") == "stragglers" and x["step"] > 1]
    return out
base = statistics.median(x["step_ms"] for x in steps("off"))
print("| configuration | median step (ms) | vs off | median gates_ms (share of the step) | "
      "median report_ms (share) |")
print("|---|---|---|---|---|")
for name in ("off", "guard", "stragglers"):
    s = steps(name)
    step = statistics.median(x["step_ms"] for x in s)
    gates = statistics.median(x.get("gates_ms", 0) for x in s)
    rep = reports(name)
    report = f"{statistics.median(rep):.4f} ({100 * statistics.median(rep) / step:.3f}%)" if rep else "-"
    print(f"| {name} | {step:.2f} | {100 * (step / base - 1):+.2f}% | {gates:.4f} "
          f"({100 * gates / step:.3f}%) | {report} |")
PY
