#!/usr/bin/env bash
# The hang watchdog (docs/distributed.md#hangs-watchdog-and-flight-recorder):
# 1. detection: time from SIGSTOP (stalled) / SIGKILL (dead) of one rank to the
#    end of the whole job, tiny llama on the CLI tests' corpus, comm.timeout_s = T;
# 2. the flight recorder's overhead: llama-60M ZeRO-3 dp 2 (the most calls per
#    step), A B A B with the recorder off (flight_records 0, no deadlines) and on
#    (defaults): the median step time of steps >= 3 and the on/off ratio.
# usage: bench/watchdog.sh [ROUNDS=2] [STEPS=6] [T=2]   (from the repository root, after a build)
set -euo pipefail
ROUNDS=${1:-2} STEPS=${2:-6} T=${3:-2}
source "$(dirname "$0")/common.sh"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"

bash tests/cli/make_inputs.sh "$work/cli" >/dev/null
for spec in "2 ddp stop" "4 ddp stop" "4 pipeline stop" "2 ddp kill" "4 pipeline kill"; do
  set -- $spec
  WATCHDOG_TIMEOUT_S=$T bash tests/watchdog/stall.sh "${MPIRUN[@]}" -np -- "$BIN" "$work/cli" "$1" "$2" "$3" \
    | grep '^DETECT' | sed "s/\$/ (comm.timeout_s = $T)/"
done

random_tokens 2000000
write_run_config <<TOML
steps = $STEPS
batch_size = 4
micro_batch_size = 2
[parallel]
zero = 3
TOML
median_ms() {
  python3 - "$1" <<'PY'
import json, statistics, sys
ms = [r["step_ms"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r and r["step"] >= 3]
print(f"{statistics.median(ms):.1f}")
PY
}
declare -A sum
for round in $(seq "$ROUNDS"); do
  for side in off on; do
    extra=()
    [ "$side" = off ] && extra=(--comm.flight_records 0 --comm.timeout_s 0 --comm.long_timeout_s 0)
    out="$work/ab.$side.$round"
    "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" --train.out_dir "$out" "${extra[@]}" >/dev/null
    ms=$(median_ms "$out/metrics.jsonl")
    echo "round $round recorder $side: $ms ms/step"
    sum[$side]=$(python3 -c "print(${sum[$side]:-0} + $ms)")
  done
done
python3 -c "print(f'recorder on / off: {${sum[on]} / ${sum[off]}:.4f}')"
