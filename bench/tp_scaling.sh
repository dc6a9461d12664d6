#!/usr/bin/env bash
# Tensor parallelism on this machine: llama-60M at a fixed global batch,
# tp 1 (one rank, all cores) against tp 2 (two ranks, half the cores each),
# with and without sequence parallelism. One JSON line per configuration.
# usage: bench/tp_scaling.sh [build dir] [steps] [global batch] [seq]
set -euo pipefail
build=${1:-build}
steps=${2:-3}
batch=${3:-8}
seq=${4:-256}
cores=$(nproc)
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
bench=$build/bench/bench_tp
common=(--model llama-60M --steps "$steps" --batch "$batch" --seq "$seq")
"${mpirun[@]}" -np 1 "$bench" "${common[@]}" --tp 1 --threads "$cores"
"${mpirun[@]}" -np 2 "$bench" "${common[@]}" --tp 2 --threads $((cores / 2))
"${mpirun[@]}" -np 2 "$bench" "${common[@]}" --tp 2 --threads $((cores / 2)) --sp 1
