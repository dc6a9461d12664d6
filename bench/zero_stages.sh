#!/usr/bin/env bash
# ZeRO stages side by side (issue 5): llama-60M (dim 512, 8 layers, GPT-2
# vocab, tied; Ψ = 53.0M parameters), bf16, sequence 256, dp 2 under mpirun,
# 1 thread per rank, BATCH sequences per rank per step:
#   - step time (the slower rank's; best and median of the timed steps) and
#     exposed communication (what the training thread waited for collectives);
#   - per-rank memory from each rank's end-of-run report: model state
#     (params + grads + optimizer, live after the last step) and the peak of
#     everything, against the formulas of docs/distributed.md;
#   - bytes per step: the CallRecord bytes of the step's collectives and what
#     a ring algorithm sends per rank, against theory (2Ψ-equivalent for
#     stages 0-2, 3Ψ for stage 3; see the table's note for the dtypes);
#   - stage 3 with prefetch off, with reshard_after_forward off, and with the
#     optimizer state offloaded to disk under a 64 MiB RAM budget.
# The machine is shared: every configuration runs once per round, rounds
# interleave them, and step times are the best (and median) over all rounds.
# usage: [ONLY="zero0 zero3 ..."] bench/zero_stages.sh [steps=3] [batch_per_rank=4] [rounds=1]
# ONLY runs just the named configurations (e.g. "zero0 zero3 zero3_noprefetch" for the
# stage-3 step-time ratio; zero0 must be among them: it gives Ψ).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-3}
BATCH=${2:-4}
ROUNDS=${3:-1}
source bench/common.sh
random_tokens 400000
write_run_config <<TOML
precision = "bf16"
steps = $((STEPS + 1))
batch_size = $((2 * BATCH))
micro_batch_size = $BATCH
log_interval = 1
TOML

run() {  # name overrides... (the name's .<round> suffix is dropped in the summary)
  local name=$1; shift
  [[ -z ${ONLY:-} || " $ONLY " == *" ${name%.*} "* ]] || return 0
  echo "== $name: $*" >&2
  "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" --train.out_dir "$work/$name" "$@" \
    >"$work/$name.log"
}
lscpu | grep "Model name" >&2
for ((r = 1; r <= ROUNDS; r++)); do
  run "zero0.$r" --parallel.zero 0
  run "zero1.$r" --parallel.zero 1
  run "zero2.$r" --parallel.zero 2
  run "zero3.$r" --parallel.zero 3
  run "zero3_noprefetch.$r" --parallel.zero 3 --parallel.prefetch false
  run "zero3_keep.$r" --parallel.zero 3 --parallel.reshard_after_forward false
  run "zero3_disk.$r" --parallel.zero 3 --parallel.offload disk --parallel.offload_budget_mb 64 \
    --parallel.offload_dir "$work/offload"
done

python3 - "$work" "$STEPS" "$BATCH" "$ROUNDS" <<'PY'
import glob, json, statistics, sys
work, steps, batch, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
MiB = 1 << 20
def load(name):
    """Per round: the ranks' timed steps; and the ranks' end-of-run memory (the same every round)."""
    rounds, end = [], None
    for run in sorted(glob.glob(f"{work}/{name}.*[0-9]")):
        ranks = [list(map(json.loads, open(p))) for p in sorted(glob.glob(f"{run}/metrics*.jsonl"))]
        rounds.append([[r for r in rows if "step_ms" in r][1:] for rows in ranks])  # skip warm-up
        end = [[r for r in rows if r.get("memory") == "end"][0]["bytes"] for rows in ranks]
    return rounds, end
log = open(f"{work}/zero0.1.log").read()
psi = int(log.split(" params\n")[0].rsplit(" ", 1)[1])
# llama-60M in bf16: every weight is a bf16 matmul weight except the 17 norms.
wide = 8 * 2 * 512 + 512           # norms (f32 compute)
narrow = psi - wide                # bf16 matmul weights
compute = 2 * narrow + 4 * wide    # bytes of the compute values
head = 4 * 512                     # the head unit (final norm; the output layer is the tied embedding)
n = 2
def formula(stage):
    if stage == 0: return 4 * psi + 2 * narrow, 4 * psi, 8 * psi
    params = compute / n if stage == 3 else compute
    grads = 4 * psi / n if stage >= 2 else 4 * psi
    return params, grads, (8 * psi + 4 * narrow) / n
def theory_bytes(stage, regather):  # CallRecord bytes per step, and ring bytes sent per rank
    if stage == 0: return 4 * psi, 2 * (n - 1) / n * 4 * psi
    total = 4 * psi + compute + (compute - head if regather else 0)
    return total, (n - 1) / n * total
print(f"llama-60M (Ψ = {psi / 1e6:.2f}M), bf16, seq 256, {batch} sequences per rank, dp 2, "
      f"1 thread per rank; {rounds} round(s) of {steps} timed steps (after 1 warm-up)")
print(f"{'run':30} {'best ms':>8} {'median':>7} {'exposed':>8} {'model state MiB':>16} "
      f"{'formula':>8} {'offloaded':>9} {'peak MiB':>9} {'MB/step':>8} {'theory':>7} "
      f"{'sent/rank':>10}")
for name, stage in [("zero0", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3),
                    ("zero3_noprefetch", 3), ("zero3_keep", 3), ("zero3_disk", 3)]:
    if not glob.glob(f"{work}/{name}.*[0-9]"):
        continue  # left out by ONLY
    rounds, end = load(name)
    slowest, exposed_ms, sent_bytes = [], [], []
    for ranks in rounds:
        for i in range(len(ranks[0])):
            slowest.append(max(rows[i]["step_ms"] for rows in ranks))
            exposed_ms.append(max(rows[i]["exposed_comm_ms"] for rows in ranks))
            sent_bytes.append(ranks[0][i]["comm_bytes"])
    exposed = statistics.median(exposed_ms)
    state = max(e["params"] + e["grads"] + e["optimizer"] for e in end)
    offloaded = max(e["offloaded"] for e in end)
    want_state = sum(formula(stage))
    if name == "zero3_disk":  # the optimizer state's resident part is at most the budget
        want_state = formula(stage)[0] + formula(stage)[1] + 64 * MiB
    peak = max(e["total_peak"] for e in end)
    sent = statistics.median(sent_bytes)
    # Stage 3 gathers again for backward unless reshard_after_forward is off.
    want_total, want_sent = theory_bytes(stage, stage == 3 and name != "zero3_keep")
    label = {"zero0": "zero 0 (DDP)", "zero3": "zero 3 (prefetch on)",
             "zero3_noprefetch": "zero 3, prefetch off",
             "zero3_keep": "zero 3, no reshard after fwd",
             "zero3_disk": "zero 3, disk offload 64 MiB"}.get(name, name.replace("zero", "zero "))
    print(f"{label:30} {min(slowest):8.0f} {statistics.median(slowest):7.0f} {exposed:8.0f} "
          f"{state / MiB:16.1f} {want_state / MiB:8.1f} {offloaded / MiB:9.1f} {peak / MiB:9.1f} "
          f"{sent / 1e6:8.1f} {want_total / 1e6:7.1f} {want_sent / 1e6:10.1f}")
print("MB/step: CallRecord bytes of the step's collectives (all_reduce: the buffer; reduce_scatter:"
      " its f32 input; all_gather: its output). theory: 4Ψ (stage 0), 4Ψ + c (1, 2),"
      " 4Ψ + 2c - c_head (3; 4Ψ + c without resharding), c = the bf16/f32 compute bytes; sent/rank: what a ring sends,"
      " 2(N-1)/N x (all-reduce) and (N-1)/N x (the others).")
PY
