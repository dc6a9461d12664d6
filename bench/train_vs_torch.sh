#!/usr/bin/env bash
# Training throughput, meshtrain vs PyTorch, side by side in one run (A B A B).
# Same Llama shape (default: dim 512, 8 layers, 8 heads, SwiGLU 1536, GPT-2
# vocab, seq 256, batch 8), AdamW, same threads. Prints a table of tokens/s,
# MFU against meshtrain's measured oneDNN matmul peak, and the ratio per pair.
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
out=$(mktemp)
lscpu | grep "Model name" >&2
for precision in fp32 bf16; do
  for ((r = 1; r <= ROUNDS; r++)); do
    "$BIN" --precision "$precision" --threads "$THREADS" "$@" >>"$out"
    /usr/bin/python3 bench/torch_train.py --precision "$precision" --threads "$THREADS" "$@" >>"$out"
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'precision':9} {'round':5} {'meshtrain tok/s':>15} {'pytorch tok/s':>13} {'ratio':>6} {'meshtrain MFU':>13} {'pytorch MFU':>11}")
for precision in ("fp32", "bf16"):
    ms = [r for r in rows if r["precision"] == precision and r["side"] == "meshtrain"]
    pt = [r for r in rows if r["precision"] == precision and r["side"] == "pytorch"]
    ratios = []
    for i, (m, p) in enumerate(zip(ms, pt), 1):
        ratio = m["tokens_per_s"] / p["tokens_per_s"]
        ratios.append(ratio)
        print(f"{precision:9} {i:5} {m['tokens_per_s']:15.0f} {p['tokens_per_s']:13.0f} {ratio:6.2f} "
              f"{m['mfu']:13.1%} {m['mfu'] / ratio:11.1%}")
    print(f"{precision:9} median ratio {statistics.median(ratios):.2f}  "
          f"(peak {ms[0]['peak_gflops']:.0f} GFLOP/s, threads {ms[0]['threads']}, "
          f"meshtrain peak memory {ms[0]['peak_memory_mib']:.0f} MiB)")
PY
rm -f "$out"
