#!/usr/bin/env bash
# Data parallelism, meshtrain (mpirun, MPI) vs PyTorch DDP (gloo), in one run
# on the same model (llama-60M: dim 512, 8 layers, SwiGLU 1536, GPT-2 vocab,
# tied), sequence 256, 1 thread per rank, bucket 25 MiB:
#   - weak scaling 1 -> 2 ranks (each rank trains BATCH sequences per step):
#     efficiency = step time at 1 rank / step time at 2 ranks;
#   - the share of the 2-rank step where communication was exposed:
#     meshtrain measures it (exposed_comm_ms: waiting for all-reduces after
#     backward), with overlap on and off; PyTorch's is the step time minus
#     that of the same step under no_sync() (torch_ddp.py alternates them);
#   - on a shared or small machine two ranks also compete for cores: "2 alone"
#     runs two independent single-rank processes at once (no communication),
#     and "vs 2 alone" = their step time / the 2-rank step time isolates what
#     data parallelism itself costs.
# Order per round: m1 p1 m2(overlap on) p2 m2(overlap off) m1 x2 p1 x2. A step
# takes as long as its slowest rank. The machine is shared: step times are the
# best step of all rounds (the least disturbed), exposed shares the median.
# usage: bench/ddp_vs_torch.sh [steps=4] [batch_per_rank=4] [rounds=1]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-4}
BATCH=${2:-4}
ROUNDS=${3:-1}
export OMP_NUM_THREADS=1
# Debian's OpenBLAS would run a generic kernel on this VM (see train_vs_torch.sh).
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -q avx512f /proc/cpuinfo; then
  export OPENBLAS_CORETYPE=SkylakeX
fi
# KEEP=1 keeps the runs' metrics (the directory is printed).
source bench/common.sh
random_tokens 400000
write_run_config <<TOML
steps = $((STEPS + 2))
log_interval = 1
[parallel]
bucket_mb = 25
TOML

m() {  # name ranks overlap [out_suffix]
  local name=$1 ranks=$2 overlap=$3
  local args=(train --config "$work/run.toml" --train.out_dir "$work/$name"
              --train.batch_size $((BATCH * ranks)) --train.micro_batch_size "$BATCH"
              --parallel.overlap "$overlap")
  echo "== meshtrain $name: ${ranks} rank(s), overlap $overlap" >&2
  if [ "$ranks" = 1 ]; then "$BIN" "${args[@]}" >"$work/$name.log"
  else "${MPIRUN[@]}" -np "$ranks" "$BIN" "${args[@]}" >"$work/$name.log"; fi
}
p() {  # ranks [port] [output]
  echo "== pytorch: $1 rank(s)" >&2
  timeout 1200 /usr/bin/python3 bench/torch_ddp.py --nproc "$1" --threads 1 --batch "$BATCH" --steps "$STEPS" \
    --port "${2:-29517}" >>"${3:-$work/torch.jsonl}"
}
# Two single-rank runs at once (each its own out_dir / port).
m_pair() {  # round
  echo "== meshtrain: 2 independent single-rank runs at once" >&2
  m "m1a.$1" 1 true & m "m1b.$1" 1 true; wait
}
p_pair() {
  echo "== pytorch: 2 independent single-rank runs at once" >&2
  p 1 29518 "$work/torch_pair.jsonl" & p 1 29519 "$work/torch_pair.jsonl"; wait
}
lscpu | grep "Model name" >&2
for ((r = 1; r <= ROUNDS; r++)); do
  m "m1.$r" 1 true; p 1; m "m2.$r" 2 true; p 2; m "m2off.$r" 2 false
  m_pair "$r"; p_pair
done

python3 - "$work" "$STEPS" "$BATCH" "$ROUNDS" <<'PY'
import glob, json, statistics, sys
work, steps, batch, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def meshtrain(name, round="*"):
    """Best step (ms), median exposed share, median exposed and comm ms over the rounds."""
    best, shares, exposed, comm = [], [], [], []
    for run in sorted(glob.glob(f"{work}/{name}.{round}")):
        if not glob.glob(f"{run}/metrics*.jsonl"):
            continue
        ranks = [[r for r in map(json.loads, open(p)) if "step_ms" in r][2:]  # skip 2 warm-up steps
                 for p in sorted(glob.glob(f"{run}/metrics*.jsonl"))]
        for i in range(len(ranks[0])):
            slowest = max(ranks, key=lambda rows: rows[i]["step_ms"])[i]
            best.append(slowest["step_ms"])
            shares.append(max(rows[i]["exposed_comm_ms"] / rows[i]["step_ms"] for rows in ranks))
            exposed.append(max(rows[i]["exposed_comm_ms"] for rows in ranks))
            comm.append(max(rows[i]["comm_ms"] for rows in ranks))
    return min(best), statistics.median(shares), statistics.median(exposed), statistics.median(comm)

torch = {1: [], 2: []}
for r in map(json.loads, open(f"{work}/torch.jsonl")):
    torch[r["ranks"]].append(r)
pair = [json.loads(l) for l in open(f"{work}/torch_pair.jsonl")]
p1 = min(r["best_ms"] for r in torch[1])
p2 = min(r["best_ms"] for r in torch[2])
p2_nosync = min(r["best_nosync_ms"] for r in torch[2])
p_share = statistics.median(r["exposed_share"] for r in torch[2])
# Two runs at once: the slower of each simultaneous pair, best over rounds.
p_pair = min(max(a["best_ms"], b["best_ms"]) for a, b in zip(pair[::2], pair[1::2]))
m1 = meshtrain("m1")[0]
m2, m2_share, m2_exp, m2_comm = meshtrain("m2")
off, off_share, off_exp, off_comm = meshtrain("m2off")
m_pair = min(max(meshtrain("m1a", r)[0], meshtrain("m1b", r)[0]) for r in range(1, rounds + 1))
tok = lambda ranks, ms: ranks * batch * 256 / ms * 1000
print(f"llama-60M, seq 256, {batch} sequences per rank per step, 1 thread per rank, bucket 25 MiB; "
      f"best step of {rounds} x {steps} (ms), median exposed share")
print(f"{'':24} {'1 rank':>7} {'2 alone':>8} {'2 ranks':>8} {'tok/s':>6} {'weak scaling':>12} "
      f"{'vs 2 alone':>10} {'exposed comm':>12}")
def row(name, one, alone, two, share, note):
    print(f"{name:24} {one:7.0f} {alone:8.0f} {two:8.0f} {tok(2, two):6.0f} {one / two:12.1%} "
          f"{alone / two:10.1%} {share:12.1%}   {note}")
row("meshtrain, overlap on", m1, m_pair, m2, m2_share,
    f"(median all-reduce time {m2_comm:.0f} ms, exposed {m2_exp:.0f} ms)")
row("meshtrain, overlap off", m1, m_pair, off, off_share,
    f"(median all-reduce time {off_comm:.0f} ms, exposed {off_exp:.0f} ms)")
row("pytorch DDP (gloo)", p1, p_pair, p2, p_share, f"(best no_sync step {p2_nosync:.0f} ms)")
PY
