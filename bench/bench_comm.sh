#!/usr/bin/env bash
# Collective bandwidth: meshtrain's calls vs the same raw MPI calls, in one run
# (meshtrain bench comm; nccl-tests' algbw/busbw definitions, see
# src/meshtrain/comm/bench.h). Full sweep 4 KB .. 256 MB, or --quick.
# usage: bench/bench_comm.sh [ranks=2] [bench comm options, e.g. --quick, --ops all_reduce]
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${1:-2}
shift $(( $# > 0 ? 1 : 0 ))
BIN=${MESHTRAIN_BIN:-build/meshtrain}
[ -x "$BIN" ] || { echo "build first (or set MESHTRAIN_BIN)" >&2; exit 1; }
MPIRUN=(mpirun --oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
lscpu | grep "Model name" >&2
"${MPIRUN[@]}" -np "$RANKS" "$BIN" bench comm "$@"
