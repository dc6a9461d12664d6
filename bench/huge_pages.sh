#!/usr/bin/env bash
# The host allocator's huge pages (tensor.cpp, kHugePage) on and off in the
# same binary, alternating A B A B: "off" preloads a shim that drops
# madvise(MADV_HUGEPAGE), so every buffer keeps the 4 KiB pages of the
# kernel's default THP mode. bench_train_step at the MoE shape of
# bench/moe_vs_dense.sh and at its dense twin; medians of the timed steps
# (wall and process CPU time).
# usage: bench/huge_pages.sh [rounds=3] [threads=2] [precision=fp32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}; THREADS=${2:-2}; PRECISION=${3:-fp32}
BIN=build/bench/bench_train_step
[ -x "$BIN" ] || { echo "build first: scripts/setup.sh" >&2; exit 1; }
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), THP mode: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
shim=build/no_huge_pages.so
cc -O2 -shared -fPIC -o "$shim" -x c - <<'C'
#define _GNU_SOURCE
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
int madvise(void* addr, size_t length, int advice) {
  if (advice == MADV_HUGEPAGE) return 0;
  return (int)syscall(SYS_madvise, addr, length, advice);
}
C
SHAPE=(--precision "$PRECISION" --threads "$THREADS" --steps 6 --dim 512 --layers 8 --heads 8
       --kv-heads 8 --vocab 8192 --seq 256 --batch 8)
export OMP_NUM_THREADS=$THREADS
for model in moe dense; do
  extra=(--experts 16 --top-k 2 --moe-hidden 512); [ $model = dense ] && extra=(--hidden 1024)
  for ((r = 1; r <= ROUNDS; r++)); do
    for side in off on; do
      pre=""; [ $side = off ] && pre=$PWD/$shim
      LD_PRELOAD=$pre "$BIN" "${SHAPE[@]}" "${extra[@]}" | grep '^{' |
        python3 -c "
import json, statistics, sys
d = json.loads(sys.stdin.read())
print(json.dumps({'model': '$model', 'round': $r, 'huge_pages': '$side', 'median_ms': d['median_ms'],
                  'cpu_ms': round(statistics.median(d['step_cpu_ms']), 1), 'tokens_per_s': d['tokens_per_s'],
                  'peak_gflops': d['peak_gflops']}))"
    done
  done
done
