#!/usr/bin/env bash
# The link between the two namespace hosts taken down in the middle of a dp 2 x pp 2 run
# (4 ranks, 2 per host; tests/multinode/bed.sh). Modes:
#   killed    the job is killed (SIGTERM to mpirun, as a user or a batch system would) while
#             the link is down: within 30 s no rank and no Open MPI daemon is left on either
#             host (the bed's TCP settings: docs/cluster.md). Needs nothing new.
#   watchdog  with comm.timeout_s = 2, a rank names the stuck call within timeout_s + 10 s of
#             the link going down, the job exits non-zero, flight records are in out_dir/flight
#             and `meshtrain debug hang` gives a diagnosis; nothing is left on either host.
#             Skipped (77) while `comm.timeout_s` is not a config key.
#   launch    under `meshtrain launch`: the link goes down in a step after the first checkpoint
#             and comes back when the first attempt has ended (by the watchdog: kind timeout);
#             launch relaunches with --resume auto and the run finishes equal to the
#             uninterrupted run bit for bit. Skipped (77) without `meshtrain launch` or
#             `comm.timeout_s`.
# usage: link_down.sh MODE MESHTRAIN CLI_WORK_DIR (the CLI tests' inputs)
set -uo pipefail
here=$(dirname "$(readlink -f "$0")")
source "$here/bed.sh"
source "$here/../support/features.sh"
mode=$1 bin=$(readlink -f "$2") inputs=$(readlink -f "$3")
work=$inputs/multinode_link_$mode
rm -rf "$work"
fail() { echo "FAIL: $*"; exit 1; }
now() { date +%s.%N; }
elapsed() { echo "$(now) - $1" | bc; }
# Each line of the job's output with the time it came.
stamp() { while IFS= read -r line; do echo "$(now) $line"; done; }
# first_stamp PATTERN FILE: the time of the first line matching PATTERN.
first_stamp() { grep -E "^[0-9.]+ $1" "$2" | head -1 | cut -d' ' -f1; }
wait_for() { # wait_for SECONDS COMMAND...: until COMMAND succeeds
  local end=$(($(date +%s) + $1)); shift
  until "$@"; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 0.1; done
}
nothing_left() { [ -z "$(bed_pids "$BED_A")$(bed_pids "$BED_B")" ]; }
show_left() {
  local h p
  for h in "$BED_A" "$BED_B"; do
    for p in $(bed_pids "$h"); do echo "  $h: $p $(cat "/proc/$p/comm" 2>/dev/null)"; done
  done
}
reached_step() { grep -qE "^[0-9.]+ step +$1/" "$2" 2>/dev/null; }

case $mode in
  killed) ;;
  watchdog | launch)
    has_config_key "$bin" "$inputs/good.toml" comm.timeout_s ||
      bed_skip "no comm.timeout_s in this build (the watchdog: branch watchdog)"
    if [ "$mode" = launch ]; then
      has_subcommand "$bin" launch || bed_skip "no 'meshtrain launch' in this build (branch launch)"
    fi
    # The watchdog, not the TCP stack, is to see the link go: connections give up after ~12 s.
    export BED_TCP_RETRIES2=5 ;;
  *) echo "usage: link_down.sh killed|watchdog|launch MESHTRAIN CLI_WORK_DIR" >&2; exit 2 ;;
esac
bed_up "$work"
args=(train --config "$inputs/good.toml" --parallel.pp 2 --train.threads 1 --train.log_interval 1
      --train.eval_interval 0)
[ "$mode" != killed ] && args+=(--comm.timeout_s 2)

# A run without an end in the background (job), the link down in its 10th step or later (down).
run_until_link_down() {
  bed_mpirun 4 "$bin" "${args[@]}" --train.steps 100000 --train.checkpoint_interval 0 \
    --train.out_dir "$work/run" > >(stamp >"$work/log") 2>&1 &
  job=$!
  wait_for 60 reached_step 10 "$work/log" || { cat "$work/log"; fail "the run did not reach step 10"; }
  bed_link down
  down=$(now)
}

if [ "$mode" = killed ]; then
  run_until_link_down
  sleep 1
  mpirun_pid=$(bed_pids "$BED_A" mpirun)
  [ -n "$mpirun_pid" ] || fail "no mpirun on $BED_A"
  kill -TERM $mpirun_pid
  wait_for 30 nothing_left || { show_left; fail "processes left 30 s after the kill with the link down"; }
  echo "killed with the link down: nothing left on either host after $(elapsed "$down") s"
  wait "$job"
  echo "link down killed: PASS"
  exit 0
fi

if [ "$mode" = watchdog ]; then
  run_until_link_down
  no_rank() { [ -z "$(bed_pids "$BED_A" meshtrain)$(bed_pids "$BED_B" meshtrain)" ]; }
  wait_for 60 no_rank
  ranks_gone=$(elapsed "$down")
  wait "$job"
  rc=$?
  ended=$(elapsed "$down")
  wait_for 30 nothing_left || { show_left; fail "processes left 30 s after the link went down"; }
  gone=$(elapsed "$down")
  cut -d' ' -f2- "$work/log" | grep -v "^step " | tail -20
  [ "$rc" -ne 0 ] || fail "the job exited 0 with the link down"
  line=$(first_stamp "rank [0-9]+: timeout: comm " "$work/log")
  [ -n "$line" ] || fail "no rank named a timed-out call"
  detected=$(echo "$line - $down" | bc)
  (($(echo "$detected <= 12" | bc))) || fail "detected after $detected s, more than timeout_s + 10 = 12 s"
  (($(echo "$ranks_gone <= 12" | bc))) || fail "ranks still running $ranks_gone s after the link went down"
  ls "$work"/run/flight/*/rank_*.json >/dev/null 2>&1 || fail "no flight records in $work/run/flight"
  "$bin" debug hang "$work/run" >"$work/debug_hang.txt" 2>&1
  cat "$work/debug_hang.txt"
  grep -q "^diagnosis: " "$work/debug_hang.txt" || fail "debug hang gave no diagnosis"
  echo "link down: detected by the watchdog after $detected s; no rank on either host after $ranks_gone s;" \
       "mpirun exit $rc after $ended s; no process (mpirun, orted) after $gone s"
  echo "link down watchdog: PASS"
  exit 0
fi

# launch: the uninterrupted run first, over the same hosts.
steps=200
args+=(--train.steps "$steps" --train.checkpoint_interval 20)
bed_mpirun 4 "$bin" "${args[@]}" --train.out_dir "$work/uninterrupted" >"$work/uninterrupted.log" 2>&1 ||
  { cat "$work/uninterrupted.log"; fail "the uninterrupted run"; }
timeout 240 "$bin" launch --max-restarts 4 --backoff 1 --log "$work/launch.jsonl" -- \
  "$BED_MPIRUN" -np 4 --host "$BED_A:2,$BED_B:2" "$bin" "${args[@]}" --train.out_dir "$work/run" \
  > >(stamp >"$work/log") 2>&1 &
job=$!
# Down in a training step after the first checkpoint (a checkpoint's calls have the long
# deadline, comm.long_timeout_s), until the first attempt has ended.
wait_for 90 reached_step 25 "$work/log" || { cat "$work/log"; fail "the run did not reach step 25 within 90 s"; }
bed_link down
down=$(now)
first_ended() { grep -q '"end"' "$work/launch.jsonl" 2>/dev/null; }
wait_for 60 first_ended || { tail -20 "$work/log"; fail "the first attempt did not end within 60 s of the link going down"; }
echo "first attempt ended $(elapsed "$down") s after the link went down; link up"
bed_link up
wait "$job"
rc=$?
cut -d' ' -f2- "$work/log" | grep -v "^step " | tail -20
[ "$rc" -eq 0 ] || fail "launch exited $rc"
python3 - "$work/launch.jsonl" <<'PY' || fail "launch's log: $(cat "$work/launch.jsonl")"
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
ends = [r for r in records if r.get("event") == "end"]
assert len(ends) >= 2, "no relaunch"
first = ends[0]
print(f"attempt 1: exit {first['exit_code']} ({first['kind']}) after {first['duration_s']:.1f} s, "
      f"checkpoint {first['checkpoint']}; cause: {first['cause']}")
# The watchdog (timeout, 7) when the link falls inside a step; when the run has moved on to a
# checkpoint (long deadline) TCP gives up first (Open MPI exits 205, "unknown"): launch must
# relaunch either way. link_down_watchdog checks the watchdog's own detection.
assert first["kind"] in ("timeout", "peer", "unknown"), f"attempt 1 ended as {first['kind']}"
assert ends[-1]["exit_code"] == 0
PY
grep -q '"event": *"resume"' "$work/run/metrics.jsonl" || fail "no resume event in the metrics"
python3 "$here/../support/compare_runs.py" 4 "$steps" "$work/uninterrupted" "$work/run" ||
  fail "the recovered run differs from the uninterrupted one"
nothing_left || { show_left; fail "processes left after launch finished"; }
echo "link down launch: PASS"
