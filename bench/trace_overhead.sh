#!/usr/bin/env bash
# The timeline trace's cost (docs/trace.md): llama-60M dp 2 (1 thread per
# rank, batch 4 x SEQ, 2 micro-batches per rank), A B A B with
# train.trace_steps off and on ("2-STEPS": every measured step traced); the
# median step time of steps >= 2 per run, the on/off ratio of the sums, and
# the trace's bytes per step per rank. With BASE_BIN set (a build without the
# tracer, e.g. main before it), also that binary against this one, trace off.
# MODEL=llama-tiny (byte vocabulary) gives the worst case: the most events
# per unit of compute. Odd rounds run off then on, even rounds on then off.
# WINDOW_RUNS=N adds N single runs with the middle third of 3 x STEPS traced.
# usage: bench/trace_overhead.sh [ROUNDS=2] [STEPS=5] [SEQ=128] [MODEL=llama-60M]
#   (from the repository root, after building meshtrain)
set -euo pipefail
ROUNDS=${1:-2} STEPS=${2:-5} SEQ=${3:-128} MODEL=${4:-llama-60M}
source "$(dirname "$0")/common.sh"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"
vocab=50257; [ "$MODEL" = llama-tiny ] && vocab=256
random_tokens 500000 "$vocab"
write_run_config <<TOML
steps = $STEPS
batch_size = 4
micro_batch_size = 1
seq_len = $SEQ
TOML
sed -i "/^seq_len = 256/d; s/^preset = .*/preset = \"$MODEL\"/" "$work/run.toml"
echo "A/B: $MODEL dp 2, batch 4 x $SEQ, 2 micro-batches per rank, $STEPS steps, 1 thread per rank"
median_ms() {
  python3 - "$1" <<'PY'
import json, statistics, sys
ms = [r["step_ms"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r and r["step"] >= 2]
print(f"{statistics.median(ms):.1f}")
PY
}
declare -A sum
sides=(off on)
[ -n "${BASE_BIN:-}" ] && sides+=(base)
for round in $(seq "$ROUNDS"); do
  order=("${sides[@]}")
  (( round % 2 == 0 )) && order=(on off "${sides[@]:2}")
  for side in "${order[@]}"; do
    bin=$BIN extra=()
    [ "$side" = on ] && extra=(--train.trace_steps "2-$STEPS")
    [ "$side" = base ] && bin=$BASE_BIN
    out="$work/ab.$side.$round"
    "${MPIRUN[@]}" -np 2 "$bin" train --config "$work/run.toml" --train.out_dir "$out" "${extra[@]}" >/dev/null
    ms=$(median_ms "$out/metrics.jsonl")
    echo "round $round trace $side: $ms ms/step"
    sum[$side]=$(python3 -c "print(${sum[$side]:-0} + $ms)")
    if [ "$side" = on ]; then
      for f in "$out"/trace/rank_*.json; do
        echo "  $(basename "$f"): $(( $(stat -c %s "$f") / (STEPS - 1) )) bytes/step, $(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['traceEvents']))" "$f") events"
      done
    fi
  done
done
python3 -c "print(f'trace on / off: {${sum[on]} / ${sum[off]}:.4f}')"
# Within one run (same processes, interleaved in time): 3 x STEPS steps, the
# middle third traced; median step of the window / of the thirds around it.
for round in $(seq "${WINDOW_RUNS:-0}"); do
  out="$work/window.$round"
  "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" --train.out_dir "$out" \
    --train.steps $((3 * STEPS)) --train.trace_steps "$((STEPS + 1))-$((2 * STEPS))" >/dev/null
  python3 - "$out/metrics.jsonl" "$STEPS" "$round" <<'PY'
import json, statistics, sys
n, ms = int(sys.argv[2]), {}
for r in map(json.loads, open(sys.argv[1])):
    if "loss" in r:
        ms[r["step"]] = r["step_ms"]
m = [statistics.median(ms[s] for s in range(a, a + n)) for a in (1 + n // 5, n + 1, 2 * n + 1)]
print(f"window run {sys.argv[3]}: before {m[0]:.2f}, traced {m[1]:.2f}, after {m[2]:.2f} ms/step: "
      f"traced / around {m[1] / ((m[0] + m[2]) / 2):.3f}")
PY
done
[ -n "${BASE_BIN:-}" ] && python3 -c "print(f'trace off / binary without the tracer: {${sum[off]} / ${sum[base]}:.4f}')"
exit 0
