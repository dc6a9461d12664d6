#!/usr/bin/env bash
# MoE training throughput (issue 25), side by side in one run (A B C D A B C D):
#  - meshtrain, a MoE of ~113M total / ~25M active parameters (dim 512, 8 layers,
#    16 SwiGLU experts of 512, top 2, vocab 8192 tied, seq 256, batch 8);
#  - meshtrain, the dense model with the same active parameters (SwiGLU 1024);
#  - transformers' Qwen3-MoE modules at the MoE's shape on PyPI PyTorch 2.x
#    (build/hf-venv, scripts/setup_hf_venv.sh), experts as grouped_mm, eager and
#    under torch.compile; without the venv those say SKIPPED.
# Same threads, AdamW, one rank. Prints tokens/s, MFU over the active FLOPs
# against meshtrain's measured matmul peak, each side's own peak, and
# meshtrain MoE / side per round, by wall time and by process CPU time.
# usage: bench/moe_vs_dense.sh [rounds=2] [threads=2] [precision=fp32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}; THREADS=${2:-2}; PRECISION=${3:-fp32}
BIN=build/bench/bench_train_step
[ -x "$BIN" ] || { echo "build first: scripts/setup.sh" >&2; exit 1; }
export OMP_NUM_THREADS=$THREADS
SHAPE=(--dim 512 --layers 8 --heads 8 --kv-heads 8 --vocab 8192 --seq 256 --batch 8)
MOE=(--experts 16 --top-k 2 --moe-hidden 512)
TORCH2=${TORCH2_PYTHON:-build/hf-venv/bin/python}
peers=()
if "$TORCH2" -c "import torch, transformers; assert int(torch.__version__.split('.')[0]) >= 2" 2>/dev/null; then
  peers+=("$TORCH2 bench/torch_moe.py" "$TORCH2 bench/torch_moe.py --compile")
  echo "pytorch $("$TORCH2" -c 'import torch, transformers; print(torch.__version__, "transformers", transformers.__version__)')" >&2
else
  echo "SKIPPED: the PyTorch 2.x Qwen3-MoE peers: no torch + transformers at $TORCH2 (scripts/setup_hf_venv.sh)" >&2
fi
lscpu | grep "Model name" >&2
out=$(mktemp)
for ((r = 1; r <= ROUNDS; r++)); do
  "$BIN" --precision "$PRECISION" --threads "$THREADS" --steps 4 "${SHAPE[@]}" "${MOE[@]}" >>"$out"
  "$BIN" --precision "$PRECISION" --threads "$THREADS" --steps 4 "${SHAPE[@]}" --hidden 1024 |
    sed 's/"side": "meshtrain"/"side": "meshtrain dense"/' >>"$out"
  for peer in "${peers[@]}"; do
    $peer --precision "$PRECISION" --threads "$THREADS" --steps 4 "${SHAPE[@]}" "${MOE[@]}" >>"$out"
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
moe = [r for r in rows if r["side"] == "meshtrain"]
m_med = statistics.median(r["tokens_per_s"] for r in moe)
mfu_m = statistics.median(r["mfu"] for r in moe)
peak_m = moe[0]["peak_gflops"]
cpu = lambda r: statistics.median(r["step_cpu_ms"])  # process CPU time of a step, both sides
print(f"{'side':36} {'params':>8} {'median tok/s':>12} {'MFU':>6} {'own peak':>8} {'MFU own':>7} "
      f"{'MoE / side':>10}  per round  {'by CPU time':>11}  per round")
for side in dict.fromkeys(r["side"] for r in rows):
    rs = [r for r in rows if r["side"] == side]
    med = statistics.median(r["tokens_per_s"] for r in rs)
    ratios = [m["tokens_per_s"] / r["tokens_per_s"] for m, r in zip(moe, rs)]
    by_cpu = [cpu(r) / cpu(m) for m, r in zip(moe, rs)]
    if side.startswith("meshtrain"):
        mfu = statistics.median(r["mfu"] for r in rs)
    else:  # the MoE's active FLOPs per token: meshtrain's MFU scaled by the rate
        mfu = mfu_m * med / m_med
    peak = statistics.median(r["peak_gflops"] for r in rs)
    own = mfu * peak_m / peak
    print(f"{side:36} {rs[0].get('params', 0) / 1e6:7.1f}M {med:12.0f} {mfu:6.1%} {peak:8.0f} "
          f"{own:7.1%} {statistics.median(ratios):10.2f}  " + " ".join(f"{x:.2f}" for x in ratios) +
          f"  {statistics.median(by_cpu):11.2f}  " + " ".join(f"{x:.2f}" for x in by_cpu))
print(f"(MFU: active FLOPs per token {moe[0]['active_flops_per_token']:.3g} for the MoE, against "
      f"meshtrain's measured peak {peak_m:.0f} GFLOP/s; 'own peak': each side's GEMM peak; "
      f"threads {moe[0]['threads']}, precision {moe[0]['precision']}; 'by CPU time': the side's "
      f"median process CPU time per step over the MoE's, a second reading: it leaves out the "
      f"time a process waits for a CPU)")
PY
rm -f "$out"
