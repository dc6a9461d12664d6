#!/usr/bin/env bash
# kill -9 of a random rank at a random step of a dp 2 run under `meshtrain
# launch`: the job finishes, its final checkpoint equals the uninterrupted
# run's bit for bit, and the metrics and launch.jsonl show the restart.
# usage: kill_rank.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/common.sh" "$@"
reference_run launch_kill 2

seed_random
kill_at=$(( 4 + RANDOM % 24 ))   # a step in 4..27 of 36
victim_rank=$(( RANDOM % 2 ))
echo "seed $seed: kill -9 rank $victim_rank after step $kill_at"
"$bin" launch --max-restarts 2 --backoff 0.2 -- "${mpirun[@]}" 2 "$bin" $(train_args "$out/run") \
  >"$out/launch.log" 2>&1 &
launch=$!
wait_steps "$out/run" "$kill_at" 60 || { cat "$out/launch.log"; fail "the run never reached step $kill_at"; }
pids=($(rank_pids "$out/run"))
(( ${#pids[@]} == 2 )) || { cat "$out/launch.log"; fail "expected 2 ranks, found ${#pids[@]}"; }
# Rank r is the process with OMPI_COMM_WORLD_RANK=r.
for pid in "${pids[@]}"; do
  if tr '\0' '\n' <"/proc/$pid/environ" | grep -qx "OMPI_COMM_WORLD_RANK=$victim_rank"; then victim=$pid; fi
done
[[ -n ${victim:-} ]] || fail "rank $victim_rank not found"
killed_after=$(steps_done "$out/run")
kill -9 "$victim"
wait "$launch"; rc=$?
cat "$out/launch.log" | grep "^launch:"
(( rc == 0 )) || { cat "$out/launch.log"; fail "launch exited $rc"; }
[[ -z $(rank_pids "$out/run") ]] || fail "ranks left running"

same_checkpoint "$out/plain/step_36" "$out/run/step_36" || fail "final checkpoint differs from the uninterrupted run"
python3 - "$out/run" "$killed_after" <<'PY' || fail "metrics or launch log do not show the restart"
import json, sys
run, killed_after = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
resumes = [r for r in rows if r.get("event") == "resume"]
assert len(resumes) == 1, resumes
r = resumes[0]
assert r["attempt"] == 2 and r["step"] % 3 == 0 and r["step"] <= killed_after + 3, r
assert r["load_ms"] > 0 and r["since_launch_ms"] > r["load_ms"], r
# Every step is there; those redone after the resume appear twice.
steps = [x["step"] for x in rows if "loss" in x]
assert sorted(set(steps)) == list(range(1, 37)), steps
log = [json.loads(l) for l in open(f"{run}/launch.jsonl")]
ends = [e for e in log if e["event"] == "end"]
assert [e["exit_code"] for e in ends] == [137, 0], ends
assert ends[0]["kind"] == "signal" and ends[0]["action"].startswith("relaunch"), ends[0]
assert log[-1]["event"] == "finish" and log[-1]["exit_code"] == 0
redone = killed_after - r["step"]
print(f"resumed at step {r['step']} (attempt 2), killed after step {killed_after}: "
      f"{redone}+ steps redone; load {r['load_ms']:.0f} ms, launch to ready {r['since_launch_ms']:.0f} ms")
PY
echo "kill rank under launch: PASS"
