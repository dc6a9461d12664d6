#!/usr/bin/env bash
# ZeRO-3 with the parameter shards in the offload store (issue 14, item 3): llama-60M
# (dim 512, 8 layers, GPT-2 vocab, tied; Ψ = 53.0M), bf16, sequence 256, dp 2 under mpirun,
# 1 thread per rank, BATCH sequences per rank per step (MICRO per micro-batch):
#   - step time (the slower rank's; best and median of the timed steps), parameters and
#     optimizer state resident (zero3), in host copies (cpu) and on disk (disk), both
#     streamed through a BUDGET MiB resident budget; configurations interleave per round
#     (A B C A B C), so the shared machine's load falls on all of them alike;
#   - the store's bytes read and written per step and rank (metrics.jsonl:
#     offload_read_bytes / offload_written_bytes) against the model state it holds
#     (compute values P, f32 masters and Adam moments) and against theory:
#     reads = m (2P - P_head) + S (every micro-batch gathers each unit in forward and all
#     but the head again in backward; the update reads the whole store S once), writes = S;
#   - the read-ahead: acquires that found their chunk already read (offload_ready) of all
#     (+ offload_waited);
#   - resident memory from each rank's end-of-run report.
# usage: [ONLY="zero3 disk"] bench/zero_param_offload.sh [steps=2] [batch_per_rank=2]
#        [micro=1] [rounds=2] [budget_mib=64]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-2}
BATCH=${2:-2}
MICRO=${3:-1}
ROUNDS=${4:-2}
BUDGET=${5:-64}
source bench/common.sh
random_tokens 200000
write_run_config <<TOML
precision = "bf16"
steps = $((STEPS + 1))
batch_size = $((2 * BATCH))
micro_batch_size = $MICRO
log_interval = 1
TOML

run() {  # name overrides...
  local name=$1; shift
  [[ -z ${ONLY:-} || " $ONLY " == *" ${name%.*} "* ]] || return 0
  echo "== $name: $*" >&2
  "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" --train.out_dir "$work/$name" \
    --parallel.zero 3 "$@" >"$work/$name.log"
}
lscpu | grep "Model name" >&2
for ((r = 1; r <= ROUNDS; r++)); do
  run "zero3.$r"
  run "cpu.$r" --parallel.offload cpu --parallel.offload_budget_mb "$BUDGET"
  run "disk.$r" --parallel.offload disk --parallel.offload_budget_mb "$BUDGET" \
    --parallel.offload_dir "$work/offload"
done

python3 - "$work" "$STEPS" "$BATCH" "$MICRO" "$ROUNDS" "$BUDGET" <<'PY'
import glob, json, statistics, sys
work, steps, batch, micro, rounds, budget = sys.argv[1], *map(int, sys.argv[2:])
MiB = 1 << 20
def load(name):
    out, end = [], None
    for run in sorted(glob.glob(f"{work}/{name}.*[0-9]")):
        ranks = [list(map(json.loads, open(p))) for p in sorted(glob.glob(f"{run}/metrics*.jsonl"))]
        out.append([[r for r in rows if "step_ms" in r][1:] for rows in ranks])  # skip warm-up
        end = [[r for r in rows if r.get("memory") == "end"][0]["bytes"] for rows in ranks]
    return out, end
first = sorted(glob.glob(f"{work}/*.1.log"))[0]
psi = int(open(first).read().split(" params\n")[0].rsplit(" ", 1)[1])
n = 2
wide = 8 * 2 * 512 + 512            # the norms: f32 compute
narrow = psi - wide                 # bf16 matmul weights
P = (2 * narrow + 4 * wide) / n     # compute values per rank (no padding in llama-60M at dp 2)
P_head = 4 * 512 / n                # the head unit: the final norm
S = (12 * psi + 2 * narrow) / n     # the store: Adam moments, f32 masters, bf16 values
m = batch // micro
want_read, want_written = m * (2 * P - P_head) + S, S
print(f"llama-60M (Ψ = {psi / 1e6:.2f}M), bf16, seq 256, {batch} sequences per rank in {m} "
      f"micro-batch(es), dp 2, 1 thread per rank, budget {budget} MiB; {rounds} round(s) of "
      f"{steps} timed steps (after 1 warm-up)")
print(f"per rank: compute values P = {P / MiB:.1f} MiB; the store S = {S / MiB:.1f} MiB "
      "(12Ψ + 2Ψn over N: moments, f32 masters, bf16 values = the rank's params + optimizer state)")
print(f"{'run':8} {'best ms':>8} {'median':>7} {'vs zero3':>8} {'read MiB/step':>14} {'theory':>7} "
      f"{'/ model':>7} {'written':>8} {'ahead %':>8} {'params MiB':>10} {'peak':>6} {'optim MiB':>9} "
      f"{'optim peak':>10} {'offloaded':>9} {'peak MiB':>9}")
base = None
for name in ["zero3", "cpu", "disk"]:
    if not glob.glob(f"{work}/{name}.*[0-9]"):
        continue
    runs, end = load(name)
    slowest, read, written, ready, waited = [], [], [], 0, 0
    for ranks in runs:
        for i in range(len(ranks[0])):
            slowest.append(max(rows[i]["step_ms"] for rows in ranks))
            read.append(max(rows[i].get("offload_read_bytes", 0) for rows in ranks))
            written.append(max(rows[i].get("offload_written_bytes", 0) for rows in ranks))
            ready += sum(rows[i].get("offload_ready", 0) for rows in ranks)
            waited += sum(rows[i].get("offload_waited", 0) for rows in ranks)
    med = statistics.median(slowest)
    base = base or med
    r, w = statistics.median(read), statistics.median(written)
    ahead = 100 * ready / (ready + waited) if ready + waited else float("nan")
    params = max(e["params"] for e in end)
    params_peak = max(e["params_peak"] for e in end)
    optim = max(e["optimizer"] for e in end)
    optim_peak = max(e["optimizer_peak"] for e in end)
    offloaded = max(e["offloaded"] for e in end)
    peak = max(e["total_peak"] for e in end)
    theory = want_read if name != "zero3" else 0
    print(f"{name:8} {min(slowest):8.0f} {med:7.0f} {med / base:8.2f} {r / MiB:14.1f} "
          f"{theory / MiB:7.1f} {r / S if r else 0:7.2f} {w / MiB:8.1f} {ahead:8.1f} "
          f"{params / MiB:10.1f} {params_peak / MiB:6.1f} {optim / MiB:9.1f} {optim_peak / MiB:10.1f} "
          f"{offloaded / MiB:9.1f} {peak / MiB:9.1f}")
print(f"theory: reads m(2P - P_head) + S = {want_read / MiB:.1f} MiB, writes S = "
      f"{want_written / MiB:.1f} MiB per step and rank; '/ model': reads over S, the "
      "rank's parameters + optimizer state")
PY
