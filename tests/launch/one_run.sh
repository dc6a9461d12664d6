#!/usr/bin/env bash
# One run per out_dir (docs/launch.md#one-run-per-out_dir), with real processes:
#  1. a second single-rank run into a live out_dir is refused (exit 9, one line
#     naming the holder's host and pid) while the first trains on and finishes
#     bit-equal to an undisturbed run;
#  2. the same for two mpirun jobs of 2 ranks (every rank refused with the same line);
#  3. a second `launch` on a launched run's out_dir, and a plain train there, are refused;
#  4. a rank of an earlier job still holding out_dir (a drain) refuses a new run,
#     and launch waits for it before relaunching;
#  5. SIGKILL releases the locks: a new run then resumes at once. Killed again
#     and again at random moments, the run's metrics hold only whole lines.
# usage: one_run.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/common.sh" "$@"
out=$work/one_run
rm -rf "$out" && mkdir -p "$out"
host=$(hostname)
seed_random
echo "seed $seed"
# The first runs of 1-3 are long enough that a second one starts while they train (a quiet
# machine ran 36 steps before a second mpirun job had started).
long=120
# A collective that hangs ends the job with a named timeout well inside the test's limit.
deadlines="--comm.timeout_s 20 --comm.long_timeout_s 60"

# (A command that should be refused at once but hangs ends after 60 s: exit 124.)
# Expects exit 9 and the refusal on every line of stderr FILE (N lines).
refused() {  # RC ERR_FILE LINES WHO
  (( $1 == 9 )) || { cat "$2"; fail "exit $1, not 9 (busy)"; }
  (( $(wc -l <"$2") == $3 )) || { cat "$2"; fail "expected $3 line(s) on stderr"; }
  grep -vq "is in use by $4" "$2" && { cat "$2"; fail "a line is not the refusal"; }
  head -1 "$2"
}

# 1. Single rank.
"$bin" $(steps=$long train_args "$out/plain") >"$out/plain.log" 2>&1 || { cat "$out/plain.log"; fail "plain run"; }
"$bin" $(steps=$long train_args "$out/a") >"$out/a.log" 2>&1 &
first=$!
wait_steps "$out/a" 3 60 || { cat "$out/a.log"; fail "the first run never reached step 3"; }
timeout -k 5 60 "$bin" $(steps=$long train_args "$out/a") --resume auto >/dev/null 2>"$out/a2.err"
refused $? "$out/a2.err" 1 "another run (meshtrain train on host $host, pid $first; lock .*owner.lock)"
wait_job "$first" 90 "the first run" "$out/a.log" || { cat "$out/a.log"; fail "the first run did not finish"; }
same_checkpoint "$out/plain/step_36" "$out/a/step_36" || fail "the first run was disturbed"
grep -q '"event": *"resume"' "$out/a/metrics.jsonl" && fail "a resume event in the first run's metrics"

# 2. Two ranks, twice.
"${mpirun[@]}" 2 "$bin" $(steps=$long train_args "$out/m" $deadlines) >"$out/m.log" 2>&1 &
first=$!
wait_steps "$out/m" 3 60 || { cat "$out/m.log"; fail "the first job never reached step 3"; }
timeout -k 5 60 "${mpirun[@]}" 2 "$bin" $(steps=$long train_args "$out/m") --resume auto >/dev/null 2>"$out/m2.err"
rc=$?
grep "^rank" "$out/m2.err" >"$out/m2.lines"
refused "$rc" "$out/m2.lines" 2 "another run (meshtrain train on host $host, pid [0-9][0-9]*; lock .*owner.lock)"
[[ $(cut -d: -f2- "$out/m2.lines" | sort -u | wc -l) == 1 ]] || fail "the ranks' lines differ"
wait_job "$first" 90 "the first job" "$out/m.log" || { cat "$out/m.log"; fail "the first job did not finish"; }
"$bin" ckpt inspect --verify "$out/m/step_36" >/dev/null || fail "the first job's checkpoint"

# 3. A launched run: a second launch and a plain train are refused.
"$bin" launch --backoff 0 -- "${mpirun[@]}" 2 "$bin" $(steps=$long train_args "$out/l" $deadlines) >"$out/l.log" 2>&1 &
launch=$!
wait_steps "$out/l" 3 60 || { cat "$out/l.log"; fail "the launched job never reached step 3"; }
timeout -k 5 60 "$bin" launch --backoff 0 -- "${mpirun[@]}" 2 "$bin" $(steps=$long train_args "$out/l") >/dev/null 2>"$out/l2.err"
refused $? "$out/l2.err" 1 "another run (meshtrain launch on host $host, pid $launch; lock .*owner.lock)"
timeout -k 5 60 "$bin" $(steps=$long train_args "$out/l") --resume auto >/dev/null 2>"$out/l3.err"
refused $? "$out/l3.err" 1 "another run (meshtrain launch on host $host, pid $launch;"
wait_job "$launch" 90 "the launched run" "$out/l.log" || { cat "$out/l.log"; fail "the launched run did not finish"; }
(( $(grep -c '"event": *"start"' "$out/l/launch.jsonl") == 1 )) || fail "the refused launch started a job"

# 4. A drain: a process holding ranks.lock as a rank does (flock(1), shared),
# longer than the 5 s a rank 0 gives an earlier job's ranks to finish.
mkdir -p "$out/d"
flock -s "$out/d/ranks.lock" sleep 7 &
drain=$!
sleep 0.3
"$bin" $(train_args "$out/d") >/dev/null 2>"$out/d.err"
refused $? "$out/d.err" 1 "ranks of an earlier job"
wait "$drain"
# Under launch: attempt 1 leaves such a process behind (outside its session,
# as a rank on another host would be) and fails; launch waits for it.
cat >"$out/drain_job.sh" <<'SH'
#!/usr/bin/env bash
if [[ $MESHTRAIN_LAUNCH_ATTEMPT == 1 ]]; then
  mkdir -p "$DRAIN_DIR"
  setsid flock -s "$DRAIN_DIR/ranks.lock" sleep 4 </dev/null >/dev/null 2>&1 &
  sleep 0.3
  exit 6
fi
exec "$@"
SH
DRAIN_DIR=$out/dl "$bin" launch --backoff 0 -- bash "$out/drain_job.sh" "$bin" $(train_args "$out/dl") \
  >"$out/dl.log" 2>&1 || { cat "$out/dl.log"; fail "launch after a drain"; }
grep "^launch:" "$out/dl.log"
grep -q "^launch: ranks of an earlier attempt still hold .*dl (holder unknown): waiting" "$out/dl.log" ||
  fail "launch did not wait for the draining rank"
python3 - "$out/dl/launch.jsonl" <<'PY' || fail "launch started the relaunch beside the draining rank"
import json, sys
log = [json.loads(l) for l in open(sys.argv[1])]
starts = [e["time"] for e in log if e["event"] == "start"]
ends = [e for e in log if e["event"] == "end"]
assert [e["exit_code"] for e in ends] == [6, 0], ends
assert starts[1] - ends[0]["time"] > 3, (starts, ends)  # the holder lived 4 s
print(f"relaunch waited {starts[1] - ends[0]['time']:.1f} s for the draining rank")
PY

# 5. SIGKILL, again and again; each new run resumes at once.
for i in 1 2 3 4 5 6; do
  "$bin" $(train_args "$out/k") --resume auto >>"$out/k.log" 2>&1 &
  pid=$!
  sleep "$(( RANDOM % 3 )).$(( RANDOM % 10 ))$(( RANDOM % 10 ))"
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  # Whole lines, but for a last one cut by a kill inside its write.
  python3 -c "
import json, sys
lines = open(sys.argv[1]).read().split('\n')[:-1]
for l in lines: json.loads(l)" "$out/k/metrics.jsonl" 2>/dev/null || [[ ! -s $out/k/metrics.jsonl ]] ||
    fail "a torn line in the metrics after kill $i"
done
"$bin" $(train_args "$out/k") --resume auto >>"$out/k.log" 2>&1 || { tail "$out/k.log"; fail "the run after the kills"; }
python3 - "$out/k/metrics.jsonl" <<'PY' || fail "metrics after the kills"
import json, sys
text = open(sys.argv[1]).read()
assert text.endswith("\n")
rows = [json.loads(l) for l in text.splitlines()]  # every line whole JSON
steps = {r["step"] for r in rows if "loss" in r}
assert steps == set(range(1, 37)), sorted(steps)
print(f"{len(rows)} whole lines after 6 kills; {sum(r.get('event') == 'resume' for r in rows)} resumes")
PY
echo "one run per out_dir: PASS"
