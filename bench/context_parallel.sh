#!/usr/bin/env bash
# Context parallelism (issue 26): one long sequence on a small Llama (dim
# 128, 2 layers, 4 heads / 2 kv heads, bf16, no recompute) at cp = 1, 2 and 4
# with each cp_comm ("allgather", "ring", and "alltoall" at cp 2: the 2 kv
# heads do not split 4 ways): step time, the cp collectives' bytes per step and
# their share of the step (the trace's spans), and rank 0's peak memory by
# category measured next to predicted (train/memory_plan.h). Then, from the
# memory plan alone (`meshtrain plan --config`), the longest sequence whose
# largest rank fits a 24 GiB device and whose ranks together fit this
# machine's MemAvailable, at cp = 1 and 4.
# usage: bench/context_parallel.sh [SEQ=16384] [STEPS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
SEQ=${1:-16384}
STEPS=${2:-3}
random_tokens $((SEQ * 4)) 512
model_config() {  # model_config SEQ CP > file
  cat <<TOML
[model]
family = "llama"
dim = 128
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 256
vocab_size = 512
max_seq_len = $1
[train]
seq_len = $1
batch_size = 1
micro_batch_size = 1
steps = $STEPS
precision = "bf16"
threads = 0
eval_interval = 0
checkpoint_interval = -1
peak_flops = 1e11
trace_steps = "2-$STEPS"
memory_check = "off"
[parallel]
cp = $2
[data]
tokenizer = "bytes"
train = "$work/train.bin"
TOML
}
lscpu | grep -m1 'Model name' || true
echo "sequence $SEQ, $STEPS steps (the first not timed), $(nproc) cores shared by the ranks"
RUNS=("1 allgather" "2 allgather" "2 ring" "2 alltoall" "4 allgather" "4 ring")
for run in "${RUNS[@]}"; do
  read -r cp method <<<"$run"
  model_config "$SEQ" "$cp" >"$work/cp$cp.toml"
  threads=$(( $(nproc) / cp )); [ "$threads" -ge 1 ] || threads=1
  "${MPIRUN[@]/OMP_NUM_THREADS=1/OMP_NUM_THREADS=$threads}" -np "$cp" "$BIN" train \
    --config "$work/cp$cp.toml" --train.out_dir "$work/cp${cp}_$method" --train.threads "$threads" \
    --parallel.cp_comm "$method" --train.log_interval 100 >"$work/cp${cp}_$method.log" 2>&1 ||
    { cat "$work/cp${cp}_$method.log"; exit 1; }
done
python3 - "$work" "$SEQ" <<'PY'
import json, sys
work, seq = sys.argv[1], int(sys.argv[2])
mib = lambda b: b / 2**20
cats = ["params", "grads", "optimizer", "activations", "workspace", "comm"]
layers, kv_width = 2, 2 * 32  # kv heads x head_dim
print(f"{'cp':>3} {'method':>9} {'step s':>7} {'cp MiB/step/rank':>17} {'cp spans':>9}   rank 0 peak MiB measured / predicted")
for run in ("1 allgather", "2 allgather", "2 ring", "2 alltoall", "4 allgather", "4 ring"):
    cp, method = int(run.split()[0]), run.split()[1]
    out = f"{work}/cp{cp}_{method}"
    recs = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    steps_ms = [r["step_ms"] for r in recs if "step_ms" in r and r.get("step", 0) >= 2]
    end = [r for r in recs if r.get("memory") == "end"][-1]
    mem = " ".join(f"{c} {mib(end['bytes'][c + '_peak']):.1f}/{mib(end['predicted'][c]):.1f}" for c in cats)
    # Rank-side bytes per layer: k/v blocks in the compute dtype (bf16), their
    # gradients in f32. All-gather: cp - 1 blocks in; the reduce-scatter's
    # cp - 1 blocks out. Ring: cp - 1 blocks forward and again backward,
    # and cp gradient blocks. Ulysses: the (cp - 1) / cp of q|k|v (f32) and
    # of the output (bf16) that leave the rank, and their gradients (d out
    # f32, d qkv bf16).
    block = 2 * (seq // cp) * kv_width
    tokens, q_width = seq // cp, 4 * 32
    if method == "allgather":
        volume = layers * (cp - 1) * block * (2 + 4)
    elif method == "ring":
        volume = layers * block * (2 * (cp - 1) * 2 + cp * 4)
    else:
        qkv = tokens * (q_width + kv_width)
        volume = layers * (cp - 1) / cp * (qkv * (4 + 2) + tokens * q_width * (2 + 4))
    volume = volume if cp > 1 else 0
    span_ms, traced_ms = 0.0, 0.0
    try:
        t = json.load(open(f"{out}/trace/rank_0.json"))
        for e in t.get("traceEvents", []):
            if e.get("name", "").startswith("cp "):
                span_ms += e.get("dur", 0) / 1e3
            if e.get("name", "").startswith("step "):
                traced_ms += e.get("dur", 0) / 1e3
    except FileNotFoundError:
        pass
    share = span_ms / traced_ms if traced_ms else 0
    print(f"{cp:>3} {method:>9} {sum(steps_ms) / len(steps_ms) / 1e3:>7.2f} {mib(volume):>17.1f} {share:>9.1%}   {mem}")
print("cp spans: rank 0's time in the cp spans over its traced steps: the all-gather and"
      " reduce-scatter (blocking), the ring's wait for the next block and its dK/dV exchange"
      " (the exposed part; the ring's transfers otherwise overlap the attention), Ulysses'"
      " four all-to-alls (blocking)")
PY
echo "longest sequence by the memory plan (bf16, no recompute):"
avail=$(awk '/MemAvailable/ {printf "%.0f", $2 * 1024}' /proc/meminfo)
for run in "1 allgather" "4 allgather" "4 ring"; do
  read -r cp method <<<"$run"
  best_dev=0; best_host=0
  for seq in 4096 8192 12288 16384 24576 32768 49152 65536 98304 131072 196608 262144 393216 524288 786432 1048576; do
    model_config "$seq" "$cp" >"$work/plan.toml"
    sed -i "s/^cp = $cp\$/cp = $cp\ncp_comm = \"$method\"/" "$work/plan.toml"
    read -r most total < <("$BIN" plan --config "$work/plan.toml" --json | python3 -c '
import json, sys
ranks = json.load(sys.stdin)["ranks"]
print(max(r["bytes"]["total"] for r in ranks), sum(r["host_bytes"] for r in ranks))')
    python3 -c "import sys; sys.exit(0 if $most <= 24 * 2**30 else 1)" && best_dev=$seq
    python3 -c "import sys; sys.exit(0 if $total <= $avail else 1)" && best_host=$seq
  done
  echo "  cp $cp $method: a 24 GiB device per rank: $best_dev tokens; this machine's MemAvailable ($((avail / 2**30)) GiB) for all ranks: $best_host tokens"
done
