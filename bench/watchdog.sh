#!/usr/bin/env bash
# The hang watchdog (docs/distributed.md#hangs-watchdog-and-flight-recorder):
# 1. detection: time from SIGSTOP (stalled) / SIGKILL (dead) of one rank to the
#    end of the whole job, tiny llama on the CLI tests' corpus, comm.timeout_s = T;
# 2. the flight recorder's overhead: ZeRO-3 dp 2 (the most calls per step) on
#    MODEL (default llama-tiny: the most calls per unit of compute, so the
#    largest relative cost), A B A B with the recorder off (flight_records 0, no
#    deadlines) and on (defaults): the median step time of steps >= 3 per run,
#    the on/off ratio of the sums; then bench_flight (ns per recorded call).
# usage: bench/watchdog.sh [ROUNDS=4] [STEPS=40] [T=2] [MODEL=llama-tiny]
#   (from the repository root, after building meshtrain and bench_flight)
set -euo pipefail
ROUNDS=${1:-4} STEPS=${2:-40} T=${3:-2} MODEL=${4:-llama-tiny}
source "$(dirname "$0")/common.sh"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"

bash tests/cli/make_inputs.sh "$work/cli" >/dev/null
for spec in "2 ddp stop" "4 ddp stop" "4 pipeline stop" "2 ddp kill" "4 pipeline kill"; do
  set -- $spec
  WATCHDOG_TIMEOUT_S=$T bash tests/watchdog/stall.sh "${MPIRUN[@]}" -np -- "$BIN" "$work/cli" "$1" "$2" "$3" \
    | grep '^DETECT' | sed "s/\$/ (comm.timeout_s = $T)/"
done

vocab=50257; [ "$MODEL" = llama-tiny ] && vocab=256
python3 - "$work/train.bin" "$vocab" <<'PY'
import random, struct, sys
random.seed(1)
n, vocab = 500000, int(sys.argv[2])
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *(random.randrange(vocab) for _ in range(n))))
PY
write_run_config <<TOML
steps = $STEPS
batch_size = 8
micro_batch_size = 2
seq_len = 64
[parallel]
zero = 3
TOML
sed -i "s/^preset = .*/preset = \"$MODEL\"/; /^seq_len = 256/d" "$work/run.toml"
echo "A/B: $MODEL ZeRO-3 dp 2, batch 8 x 64, 2 micro-batches per rank, $STEPS steps, 1 thread per rank"

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

FLIGHT_BENCH=${FLIGHT_BENCH:-build/bench/bench_flight}
[ -x "$FLIGHT_BENCH" ] && "$FLIGHT_BENCH" --benchmark_min_time=0.2 2>/dev/null | grep BM_
