#!/usr/bin/env bash
# Expert parallelism (issue 25): the same MoE run at ep 1, 2 and 4 over the
# same dp, under mpirun with 1 thread per rank:
#   - the MoE: llama-60M's trunk (dim 512, 8 layers, GPT-2 vocab, tied) with
#     every feed-forward 8 SwiGLU experts of 512, top 2 (~104M parameters,
#     ~40M active), fp32, sequence 256, BATCH sequences per rank per step,
#     random tokens;
#   - per configuration: step time (the slower rank's median over the timed
#     steps), the all-to-all bytes a rank sent per step and their busy time
#     (its share of the step: all of it is exposed, the exchange blocks the
#     compute), the DDP gradient bytes per step, and the experts' imbalance
#     (max / mean choices per expert, worst layer, median step).
# dp 2 (ep 1, 2) runs 2 ranks; dp 4 (ep 1, 2, 4) runs 4 ranks, which on a
# 2-core machine share the cores: its step times measure the oversubscribed
# machine, its bytes and imbalance do not depend on it.
# usage: bench/moe_ep.sh [steps=3] [batch_per_rank=4] [rounds=1]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-3}
BATCH=${2:-4}
ROUNDS=${3:-1}
source bench/common.sh
random_tokens 400000
write_run_config <<TOML
precision = "fp32"
steps = $((STEPS + 1))
batch_size = $BATCH
micro_batch_size = $BATCH
log_interval = 1
[moe]
experts = 8
top_k = 2
hidden_dim = 512
TOML

run() {  # name ranks overrides...
  local name=$1 np=$2; shift 2
  echo "== $name: np $np $*" >&2
  "${MPIRUN[@]}" -np "$np" "$BIN" train --config "$work/run.toml" --train.out_dir "$work/$name" \
    --train.batch_size $((np * BATCH)) "$@" >"$work/$name.log"
}
lscpu | grep "Model name" >&2
for ((r = 1; r <= ROUNDS; r++)); do
  run "dp2_ep1.$r" 2 --parallel.ep 1
  run "dp2_ep2.$r" 2 --parallel.ep 2
  run "dp4_ep1.$r" 4 --parallel.ep 1
  run "dp4_ep2.$r" 4 --parallel.ep 2
  run "dp4_ep4.$r" 4 --parallel.ep 4
done

python3 - "$work" <<'PY'
import glob, json, statistics, sys
work = sys.argv[1]
print(f"{'run':10} {'step ms':>8} {'vs ep 1':>7} {'a2a MB/step':>11} {'a2a ms':>7} {'a2a share':>9} "
      f"{'DDP MB/step':>11} {'imbalance':>9}")
base = {}
for name in ["dp2_ep1", "dp2_ep2", "dp4_ep1", "dp4_ep2", "dp4_ep4"]:
    steps, a2a_b, a2a_ms, ddp_b, imb = [], [], [], [], []
    for run in sorted(glob.glob(f"{work}/{name}.*[0-9]")):
        ranks = [[json.loads(l) for l in open(p)] for p in sorted(glob.glob(f"{run}/metrics*.jsonl"))]
        ranks = [[r for r in rows if "step_ms" in r][1:] for rows in ranks]  # skip warm-up
        for i in range(len(ranks[0])):
            rows = [rk[i] for rk in ranks]
            steps.append(max(r["step_ms"] for r in rows))
            a2a_b.append(statistics.mean(r.get("ep_comm_bytes", 0) for r in rows))
            a2a_ms.append(statistics.mean(r.get("ep_comm_ms", 0) for r in rows))
            ddp_b.append(statistics.mean(r["comm_bytes"] for r in rows))
            imb.append(max(m["imbalance"] for m in rows[0]["moe"]))
    step = statistics.median(steps)
    dp = name.split("_")[0]
    base.setdefault(dp, step)
    ms = statistics.median(a2a_ms)
    print(f"{name:10} {step:8.0f} {step / base[dp]:7.2f} {statistics.median(a2a_b) / 1e6:11.2f} "
          f"{ms:7.1f} {ms / step:9.1%} {statistics.median(ddp_b) / 1e6:11.1f} "
          f"{statistics.median(imb):9.2f}")
print("(a2a: the bytes each rank sent in the step's all-to-alls and their busy time; "
      "DDP: the gradient all-reduces' bytes (CallRecord)")
PY
