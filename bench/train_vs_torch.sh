#!/usr/bin/env bash
# Training throughput, meshtrain vs PyTorch, side by side in one run (A B C D A B C D).
# Same Llama shape (default: dim 512, 8 layers, 8 heads, SwiGLU 1536, GPT-2
# vocab, seq 256, batch 8), AdamW, same threads. The peers: Debian's PyTorch 1.13
# eager, and PyTorch 2.x from PyPI eager and under torch.compile when its venv is
# there (scripts/setup_hf_venv.sh: build/hf-venv, or TORCH2_PYTHON=path/to/python);
# without it those two say SKIPPED. Prints tokens/s, MFU against meshtrain's
# measured oneDNN matmul peak, and meshtrain's ratio to each peer.
# usage: bench/train_vs_torch.sh [rounds=2] [threads=2] [extra model args...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}; THREADS=${2:-2}; shift $(( $# > 2 ? 2 : $# )) || true
BIN=build/bench/bench_train_step
[ -x "$BIN" ] || { echo "build first: scripts/setup.sh" >&2; exit 1; }
export OMP_NUM_THREADS=$THREADS
# Debian's OpenBLAS detects this VM's CPU as "Prescott" and runs a generic kernel
# (~40 GFLOP/s); the peer gets the AVX-512 kernel unless the caller chose one.
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -q avx512f /proc/cpuinfo; then
  export OPENBLAS_CORETYPE=SkylakeX
fi
/usr/bin/python3 -c "import ctypes; l = ctypes.CDLL('libblas.so.3'); l.openblas_get_corename.restype = ctypes.c_char_p; print('pytorch fp32 BLAS: OpenBLAS', l.openblas_get_corename().decode())" >&2 || true
TORCH2=${TORCH2_PYTHON:-build/hf-venv/bin/python}
peers=("/usr/bin/python3 bench/torch_train.py")
if "$TORCH2" -c "import torch; assert int(torch.__version__.split('.')[0]) >= 2" 2>/dev/null; then
  peers+=("$TORCH2 bench/torch_train.py" "$TORCH2 bench/torch_train.py --compile")
  echo "pytorch 2.x: $("$TORCH2" -c 'import torch; print(torch.__version__)') ($TORCH2)" >&2
else
  echo "SKIPPED: the PyTorch 2.x peers (eager, torch.compile): no $TORCH2 (scripts/setup_hf_venv.sh)" >&2
fi
out=$(mktemp)
lscpu | grep "Model name" >&2
for precision in fp32 bf16; do
  for ((r = 1; r <= ROUNDS; r++)); do
    "$BIN" --precision "$precision" --threads "$THREADS" "$@" >>"$out"
    for peer in "${peers[@]}"; do
      $peer --precision "$precision" --threads "$THREADS" "$@" >>"$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'precision':9} {'side':24} {'median tok/s':>12} {'MFU':>6} {'own peak':>8} {'MFU own':>7} "
      f"{'meshtrain / side':>16}  per round")
for precision in ("fp32", "bf16"):
    ms = [r for r in rows if r["precision"] == precision and r["side"] == "meshtrain"]
    m_med = statistics.median(r["tokens_per_s"] for r in ms)
    for side in dict.fromkeys(r["side"] for r in rows if r["precision"] == precision):
        rs = [r for r in rows if r["precision"] == precision and r["side"] == side]
        med = statistics.median(r["tokens_per_s"] for r in rs)
        # Same tokens and FLOPs per step on both sides: a peer's MFU against meshtrain's
        # peak is meshtrain's over the ratio; against the peer's own GEMM peak, scaled by both.
        ratios = [m["tokens_per_s"] / r["tokens_per_s"] for m, r in zip(ms, rs)]
        mfu = statistics.median(m["mfu"] for m in ms) * med / m_med
        peak = statistics.median(r["peak_gflops"] for r in rs)
        own = mfu * ms[0]["peak_gflops"] / peak
        print(f"{precision:9} {side:24} {med:12.0f} {mfu:6.1%} {peak:8.0f} {own:7.1%} "
              f"{statistics.median(ratios):16.2f}  " + " ".join(f"{x:.2f}" for x in ratios))
    print(f"{precision:9} (MFU against meshtrain's measured peak {ms[0]['peak_gflops']:.0f} GFLOP/s; "
          f"'own peak': each side's GEMM peak, GFLOP/s; threads {ms[0]['threads']}, "
          f"meshtrain peak memory {ms[0]['peak_memory_mib']:.0f} MiB)")
PY
rm -f "$out"
