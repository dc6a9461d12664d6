#!/usr/bin/env bash
# Preemption: SIGTERM to one rank of a dp 2 run under `meshtrain launch` ⇒
# every rank checkpoints at the next step boundary and exits 75, launch
# resumes it, and the result equals the uninterrupted run bit for bit.
# SIGTERM to launch itself ⇒ forwarded to the ranks, exit 75, no relaunch;
# a second launch finishes the run, again bit-equal.
# usage: preempt.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/common.sh" "$@"
reference_run launch_preempt 2
seed_random
at=$(( 4 + RANDOM % 20 ))
echo "seed $seed: SIGTERM after step $at"

# 1. One rank signalled.
"$bin" launch --max-restarts 2 --backoff 5 -- "${mpirun[@]}" 2 "$bin" $(train_args "$out/one") \
  >"$out/one.log" 2>&1 &
launch=$!
wait_steps "$out/one" "$at" 60 || { cat "$out/one.log"; fail "never reached step $at"; }
pids=($(rank_pids "$out/one"))
kill -TERM "${pids[$(( RANDOM % 2 ))]}"
wait "$launch"; rc=$?
grep "^launch:" "$out/one.log"
(( rc == 0 )) || { cat "$out/one.log"; fail "launch exited $rc"; }
grep -q "^rank [01]: preempted at step" "$out/one.log" || fail "no 'preempted' line from the ranks"
same_checkpoint "$out/plain/step_36" "$out/one/step_36" || fail "preempted run differs from the uninterrupted one"
python3 - "$out/one" <<'PY' || fail "metrics / launch log"
import json, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
pre = [r for r in rows if r.get("event") == "preempted"]
res = [r for r in rows if r.get("event") == "resume"]
assert len(pre) == 1 and pre[0]["ranks_signalled"] == 1, pre
assert len(res) == 1 and res[0]["step"] == pre[0]["step"], (pre, res)  # nothing redone
log = [json.loads(l) for l in open(f"{run}/launch.jsonl")]
ends = [e for e in log if e["event"] == "end"]
assert [(e["exit_code"], e["kind"]) for e in ends] == [(75, "preempted"), (0, "ok")], ends
assert ends[0]["backoff_s"] == 0, ends[0]  # resumed at once
print(f"preempted at step {pre[0]['step']}, resumed there: 0 steps redone")
PY

# 2. launch itself signalled: forwarded, no relaunch, exit 75.
"$bin" launch --max-restarts 2 --backoff 0 -- "${mpirun[@]}" 2 "$bin" $(train_args "$out/self") \
  >"$out/self.log" 2>&1 &
launch=$!
wait_steps "$out/self" "$at" 60 || { cat "$out/self.log"; fail "never reached step $at"; }
kill -TERM "$launch"
wait "$launch"; rc=$?
grep "^launch:" "$out/self.log"
(( rc == 75 )) || { cat "$out/self.log"; fail "signalled launch exited $rc, not 75"; }
[[ -z $(rank_pids "$out/self") ]] || fail "ranks left running"
(( $(grep -c '"event": *"start"' "$out/self/launch.jsonl") == 1 )) || fail "launch relaunched after being signalled"
python3 -c "
import json,sys; rows=[json.loads(l) for l in open('$out/self/metrics.jsonl')]
p=[r for r in rows if r.get('event')=='preempted']; assert len(p)==1 and p[0]['ranks_signalled']>=1, p" ||
  fail "no preempted event"
"$bin" launch --backoff 0 -- "${mpirun[@]}" 2 "$bin" $(train_args "$out/self") --resume auto >"$out/self2.log" 2>&1 ||
  { cat "$out/self2.log"; fail "the second launch failed"; }
same_checkpoint "$out/plain/step_36" "$out/self/step_36" || fail "run resumed by a second launch differs"
echo "preemption under launch: PASS"
