#!/usr/bin/env bash
# Recovery from a killed rank under `meshtrain launch` (issue 15, items 4-5): a dp 2 run
# (mpirun, 1 thread per rank) is killed (SIGKILL of rank 1) after step KILL; launch
# relaunches it with --resume auto (--backoff 0). For each checkpoint interval:
#   - time to recover, from the kill to the end of the first new step, split into
#     detect (kill -> launch sees the job exit), respawn (-> the next attempt starts),
#     relaunch (attempt start -> trainer constructed, less the load: mpirun, MPI init,
#     config, data, model), checkpoint load, and the first step (warm-up) next to the
#     median step after it;
#   - lost work: steps redone = the last step logged before the kill - the step resumed
#     from (plus the step in flight), against the interval (expected ~ interval / 2).
# Also: SIGTERM to launch -> exit 75 (the step in flight, the checkpoint, the exit), and the
# cost of the preemption hook's per-step all-reduce (8 bytes over the world).
# usage: [MODEL=small|60M] bench/launch_recovery.sh [steps=30] [kill_after=17] [intervals="2 5 10"]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-30}
KILL=${2:-17}
INTERVALS=${3:-"2 5 10"}
source bench/common.sh
if [ "${MODEL:-small}" = 60M ]; then
  random_tokens 400000
  write_run_config <<TOML
steps = $STEPS
batch_size = 4
micro_batch_size = 2
TOML
else
  # 3.4M parameters (dim 256, 4 layers, byte vocabulary): ~40 MB of checkpoint.
  random_tokens 200000 256 3
  cat >"$work/run.toml" <<TOML
[model]
family = "llama"
dim = 256
n_layers = 4
n_heads = 4
n_kv_heads = 2
hidden_dim = 688
vocab_size = 256
max_seq_len = 128
[train]
steps = $STEPS
batch_size = 8
seq_len = 128
threads = 1
eval_interval = 0
peak_flops = 1e11
[data]
train = "$work/train.bin"
tokenizer = "bytes"
TOML
fi
echo "model ${MODEL:-small}, $STEPS steps, SIGKILL of rank 1 after step $KILL, dp 2"
printf "%-9s %-7s %-7s %-7s %-9s %-9s %-10s %-8s %-10s %-10s %-10s\n" interval resumed redone \
  detect_s respawn_s relaunch_s load_s first_ms steady_ms recovery_s
for interval in $INTERVALS; do
  out="$work/i$interval"
  "$BIN" launch --backoff 0 -- "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" \
    --train.checkpoint_interval "$interval" --train.out_dir "$out" >"$out.log" 2>&1 &
  launch=$!
  until n=$(grep -c '"loss"' "$out/metrics.jsonl" 2>/dev/null); [ "${n:-0}" -ge "$KILL" ]; do sleep 0.01; done
  victim=$(for p in $(pgrep -f "^$BIN train .*--train.out_dir $out\$"); do
    tr '\0' '\n' <"/proc/$p/environ" | grep -qx OMPI_COMM_WORLD_RANK=1 && echo "$p"; done)
  t_kill=$(date +%s.%N)
  kill -9 "$victim"
  wait "$launch" || { cat "$out.log"; exit 1; }
  python3 - "$out" "$t_kill" "$interval" <<'PY'
import json, statistics, sys
out, t_kill, interval = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
at = next(i for i, r in enumerate(rows) if r.get("event") == "resume")
res = rows[at]
before = [r["step"] for r in rows[:at] if "loss" in r]
after = [r for r in rows[at:] if "loss" in r]
log = [json.loads(l) for l in open(f"{out}/launch.jsonl")]
end1 = next(e for e in log if e["event"] == "end")
start2 = [e for e in log if e["event"] == "start"][1]
first, steady = after[0]["step_ms"], statistics.median(r["step_ms"] for r in after[1:])
detect, respawn = end1["time"] - t_kill, start2["time"] - end1["time"]
relaunch = (res["since_launch_ms"] - res["load_ms"]) / 1e3
recovery = start2["time"] - t_kill + res["since_launch_ms"] / 1e3 + first / 1e3
print(f"{interval:<9} {res['step']:<7} {max(before) - res['step']:<7} {detect:<9.2f} {respawn:<9.2f} "
      f"{relaunch:<10.2f} {res['load_ms'] / 1e3:<8.3f} {first:<10.1f} {steady:<10.1f} {recovery:<10.2f}")
PY
done
# Preemption: SIGTERM to launch after step KILL -> checkpoint -> exit 75.
out="$work/preempt"
"$BIN" launch --backoff 0 -- "${MPIRUN[@]}" -np 2 "$BIN" train --config "$work/run.toml" \
  --train.checkpoint_interval -1 --train.out_dir "$out" >"$out.log" 2>&1 &
launch=$!
until n=$(grep -c '"loss"' "$out/metrics.jsonl" 2>/dev/null); [ "${n:-0}" -ge "$KILL" ]; do sleep 0.01; done
t_sig=$(date +%s.%N)
kill -TERM "$launch"
rc=0; wait "$launch" || rc=$?
t_end=$(date +%s.%N)
python3 - "$out" "$t_sig" "$t_end" "$rc" <<'PY'
import json, statistics, sys
out, t_sig, t_end, rc = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
pre = next(r for r in rows if r.get("event") == "preempted")
step = statistics.median(r["step_ms"] for r in rows if "loss" in r)
print(f"SIGTERM to launch: exit {rc} "
      f"{t_end - t_sig:.2f} s later (checkpoint of step {pre['step']}; median step {step:.0f} ms)")
PY
# The preemption agreement's cost: an 8-byte all-reduce per step, timed alone.
echo "the preemption hook's per-step all-reduce (8 bytes, 2 ranks):"
"${MPIRUN[@]}" -np 2 "$BIN" bench comm --ops all_reduce --min-size 8 --max-size 8 2>&1 | tail -2
