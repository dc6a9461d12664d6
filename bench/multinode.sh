#!/usr/bin/env bash
# Two namespace hosts on this machine (tests/multinode/bed.sh, docs/cluster.md), as root:
#  1. 4 KiB .. 64 KiB send/recv and all_reduce latency, 2 ranks (meshtrain bench comm): one
#     host (shared memory), two hosts across the veth with and without mpi_yield_when_idle;
#  2. the training step of dp 2 x pp 2 (llama-tiny on the CLI tests' byte corpus, 4 ranks,
#     1 thread each): one host vs two hosts, with and without mpi_yield_when_idle (median
#     step_ms over the steps after the 10th).
# usage: bench/multinode.sh [steps=60] [all|comm|train]
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-60} PART=${2:-all}
BIN=$(readlink -f "${MESHTRAIN_BIN:-build/meshtrain}")
[ -x "$BIN" ] || { echo "build first (or set MESHTRAIN_BIN)" >&2; exit 1; }
source tests/multinode/bed.sh
work=$(mktemp -d /tmp/meshtrain-bench-multinode.XXXXXX)
inputs=$work/inputs
bash tests/cli/make_inputs.sh "$inputs" >/dev/null
lscpu | grep "Model name"
comm=(bench comm --quick --ops sendrecv all_reduce --max-size 64K)
show() { grep -E "^(op|send/recv|all_reduce) "; }

if [ "$PART" != train ]; then
echo "== one host (mpirun -np 2, shared memory)"
mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${comm[@]}" | show
for yield in 1 0; do
  echo "== two hosts, mpi_yield_when_idle $yield"
  (
    export BED_YIELD=$yield
    bed_up "$work/bed_yield$yield" >/dev/null
    bed_mpirun 2 "$BIN" "${comm[@]}" | show
  )
done
fi
[ "$PART" = comm ] && { rm -rf "$work"; exit 0; }

args=(train --config "$inputs/good.toml" --parallel.pp 2 --train.threads 1 --train.steps "$STEPS"
      --train.log_interval 1000 --train.eval_interval 0 --train.checkpoint_interval 0)
median_step() {
  python3 - "$1/metrics.jsonl" <<'PY'
import json, statistics, sys
ms = [r["step_ms"] for r in map(json.loads, open(sys.argv[1])) if "step_ms" in r and r["step"] > 10]
print(f"median step {statistics.median(ms):.1f} ms over {len(ms)} steps")
PY
}
echo "== dp 2 x pp 2, llama-tiny, $STEPS steps"
for yield in 0 1; do
  mpirun --allow-run-as-root --oversubscribe -np 4 --mca mpi_yield_when_idle $yield "$BIN" "${args[@]}" \
    --train.out_dir "$work/one_host$yield" >/dev/null &&
    echo "one host, mpi_yield_when_idle $yield: $(median_step "$work/one_host$yield")"
done
for yield in 1 0; do
  (
    export BED_YIELD=$yield
    bed_up "$work/bed_train$yield" >/dev/null
    bed_mpirun 4 "$BIN" "${args[@]}" --train.out_dir "$work/two_hosts$yield" >/dev/null &&
      echo "two hosts, mpi_yield_when_idle $yield: $(median_step "$work/two_hosts$yield")"
  )
done
rm -rf "$work"
