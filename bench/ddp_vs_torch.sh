#!/usr/bin/env bash
# Data parallelism, meshtrain (mpirun, MPI) vs PyTorch DDP (gloo), in one run
# on the same model (llama-60M: dim 512, 8 layers, SwiGLU 1536, GPT-2 vocab,
# tied), sequence 256, 1 thread per rank, bucket 25 MiB:
#   - weak scaling 1 -> 2 ranks (each rank trains BATCH sequences per step):
#     efficiency = step time at 1 rank / step time at 2 ranks;
#   - the share of the 2-rank step where communication was exposed:
#     meshtrain measures it (exposed_comm_ms: waiting for all-reduces after
#     backward), with overlap on and off; PyTorch's is the step time minus
#     that of the same step under no_sync() (torch_ddp.py alternates them).
# Order: m1 p1 m2(overlap on) p2 m2(overlap off); medians over STEPS timed steps.
# usage: bench/ddp_vs_torch.sh [steps=4] [batch_per_rank=4]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-4}
BATCH=${2:-4}
BIN=${MESHTRAIN_BIN:-build/meshtrain}
[ -x "$BIN" ] || { echo "build first (or set MESHTRAIN_BIN)" >&2; exit 1; }
MPIRUN=(mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
export OMP_NUM_THREADS=1
# Debian's OpenBLAS would run a generic kernel on this VM (see train_vs_torch.sh).
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -q avx512f /proc/cpuinfo; then
  export OPENBLAS_CORETYPE=SkylakeX
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Throughput only: random GPT-2 token ids in llm.c's format.
python3 - "$work/train.bin" <<'PY'
import random, struct, sys
random.seed(1)
n = 400_000
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *(random.randrange(50257) for _ in range(n))))
PY
cat >"$work/run.toml" <<TOML
[model]
preset = "llama-60M"
[train]
steps = $((STEPS + 2))
seq_len = 256
threads = 1
eval_interval = 0
log_interval = 1
peak_flops = 1e11
checkpoint_interval = -1
[data]
train = "$work/train.bin"
[parallel]
bucket_mb = 25
TOML

m() {  # name ranks overlap
  local name=$1 ranks=$2 overlap=$3
  local args=(train --config "$work/run.toml" --train.out_dir "$work/$name"
              --train.batch_size $((BATCH * ranks)) --train.micro_batch_size "$BATCH"
              --parallel.overlap "$overlap")
  echo "== meshtrain $name: ${ranks} rank(s), overlap $overlap" >&2
  if [ "$ranks" = 1 ]; then "$BIN" "${args[@]}" >"$work/$name.log"
  else "${MPIRUN[@]}" -np "$ranks" "$BIN" "${args[@]}" >"$work/$name.log"; fi
}
p() {  # ranks
  echo "== pytorch: $1 rank(s)" >&2
  /usr/bin/python3 bench/torch_ddp.py --nproc "$1" --threads 1 --batch "$BATCH" --steps "$STEPS" \
    >>"$work/torch.jsonl"
}
lscpu | grep "Model name" >&2
m m1 1 true; p 1; m m2 2 true; p 2; m m2off 2 false

python3 - "$work" "$STEPS" "$BATCH" <<'PY'
import glob, json, os, statistics, sys
work, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def meshtrain(name):
    ranks = []
    for path in sorted(glob.glob(f"{work}/{name}/metrics*.jsonl")):
        rows = [json.loads(l) for l in open(path)][2:]  # skip two warm-up steps
        ranks.append(rows)
    step = max(statistics.median(r["step_ms"] for r in rows) for rows in ranks)
    exposed = max(statistics.median(r["exposed_comm_ms"] for r in rows) for rows in ranks)
    comm = max(statistics.median(r["comm_ms"] for r in rows) for rows in ranks)
    return step, exposed, comm

torch = {r["ranks"]: r for r in map(json.loads, open(f"{work}/torch.jsonl"))}
m1, _, _ = meshtrain("m1")
m2, m2_exp, m2_comm = meshtrain("m2")
off, off_exp, off_comm = meshtrain("m2off")
p1, p2 = torch[1]["step_ms"], torch[2]["step_ms"]
tok = lambda ranks, ms: ranks * batch * 256 / ms * 1000
print(f"llama-60M, seq 256, {batch} sequences per rank per step, 1 thread per rank, bucket 25 MiB; "
      f"medians of {steps} steps")
print(f"{'':28} {'1 rank ms':>10} {'2 ranks ms':>10} {'tok/s (2)':>10} {'weak scaling':>12} {'exposed comm':>13}")
print(f"{'meshtrain, overlap on':28} {m1:10.0f} {m2:10.0f} {tok(2, m2):10.0f} {m1 / m2:12.1%} "
      f"{m2_exp / m2:13.1%}   (all-reduce busy {m2_comm:.0f} ms, exposed {m2_exp:.0f} ms)")
print(f"{'meshtrain, overlap off':28} {m1:10.0f} {off:10.0f} {tok(2, off):10.0f} {m1 / off:12.1%} "
      f"{off_exp / off:13.1%}   (all-reduce busy {off_comm:.0f} ms, exposed {off_exp:.0f} ms)")
print(f"{'pytorch DDP (gloo)':28} {p1:10.0f} {p2:10.0f} {tok(2, p2):10.0f} {p1 / p2:12.1%} "
      f"{torch[2]['exposed_share']:13.1%}   (no_sync step {torch[2]['nosync_ms']:.0f} ms)")
PY
