#!/usr/bin/env bash
# Pipeline schedules side by side (issue 8): llama-60M (dim 512, 8 layers,
# GPT-2 vocab, tied), bf16, sequence 256, 8 micro-batches of 1 sequence per
# step, pp 2 and 4 under mpirun (1 thread per rank), GPipe, 1F1B and
# interleaved 1F1B (v = 2). Per run, from every rank's metrics:
#   - the measured bubble (schedule time - compute) / compute, mean over
#     ranks and timed steps, next to the theoretical (p - 1) / (v m) (which
#     the simulator of schedule.h reproduces: tests/pipeline);
#   - busy / wait per rank (ms per step);
#   - micro-batches held at once and the activation peak per stage (the
#     memory tracker's activations category).
# The last stage also holds the head (tied 50257 x 512: about 7 layers' FLOPs);
# the default split (parallel.pp_split = "auto") balances the stages' FLOPs,
# ":uniform" splits by layer count, ":7,1" and the like are explicit splits.
# usage: bench/pipeline_schedules.sh [steps=2] [pp:schedule[:split] ...]
#        (the first step is not timed; default: every case below)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-2}
shift || true
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(2:gpipe 2:1f1b 2:interleaved 2:1f1b:uniform 4:gpipe 4:1f1b
                                 4:interleaved 4:1f1b:uniform)
source bench/common.sh
random_tokens 200000
write_run_config <<TOML
precision = "bf16"
steps = $((STEPS + 1))
batch_size = 8
micro_batch_size = 1
TOML

printf "%-3s %-16s %-8s %-8s %-22s %-10s %s\n" pp schedule bubble theory "busy/wait ms (rank 0)" in-flight "activation peak MiB per stage"
for case in "${CASES[@]}"; do
    IFS=: read -r pp schedule split <<<"$case"
    v=1; [ $schedule = interleaved ] && v=2
    out=$work/pp${pp}_${schedule}${split:+_$split}
    "${MPIRUN[@]}" -np $pp "$BIN" train --config "$work/run.toml" --parallel.pp $pp \
      --parallel.schedule $schedule --parallel.virtual_stages $v --parallel.pp_split "${split:-auto}" \
      --train.out_dir "$out" >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
    python3 - "$out" $pp $v "$schedule${split:+ $split}" <<'PY'
import glob, json, sys
out, pp, v, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ranks = sorted(glob.glob(out + "/metrics*.jsonl"), key=lambda p: (len(p), p))
bubbles, peaks, held, busy_wait = [], [], [], None
for path in ranks:
    rows = list(map(json.loads, open(path)))
    steps = [r for r in rows if "loss" in r][1:]  # the first step warms up
    bubbles += [r["pp_bubble"] for r in steps]
    held.append(max(r["pp_in_flight"] for r in steps))
    if busy_wait is None:
        busy_wait = "%.0f / %.0f" % (sum(r["pp_busy_ms"] for r in steps) / len(steps),
                                     sum(r["pp_wait_ms"] for r in steps) / len(steps))
    end = [r for r in rows if r.get("memory") == "end"][-1]
    peaks.append(end["bytes"]["activations_peak"] / 2**20)
    theory = steps[-1]["pp_bubble_theory"]
print("%-3d %-16s %-8.3f %-8.3f %-22s %-10s %s" % (
    pp, label, sum(bubbles) / len(bubbles), theory, busy_wait,
    ",".join(map(str, held)), " ".join("%.0f" % p for p in peaks)))
PY
done
