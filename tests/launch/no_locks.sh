#!/usr/bin/env bash
# On a file system without locks (simulated: tests/support/no_flock.cpp, an
# LD_PRELOAD shim making every flock(2) fail with ENOLCK) a run and a launch
# warn once and train; docs/launch.md#one-run-per-out_dir.
# usage: no_locks.sh SHIM MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
shim=$1; shift
source "$(dirname "$0")/common.sh" "$@"
out=$work/no_locks
rm -rf "$out" && mkdir -p "$out"
# (Under AddressSanitizer the shim comes before its runtime: allowed, it only wraps flock.)
ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0 LD_PRELOAD=$shim "$bin" launch -- "$bin" $(train_args "$out/run") --train.steps 6 >"$out/log" 2>"$out/err" ||
  { cat "$out/log" "$out/err"; fail "the run failed without locks"; }
cat "$out/err"
(( $(grep -c "^launch: warning: train.out_dir '.*run' is on a file system without locks (.*owner.lock: No locks available): nothing keeps a second run out of it" "$out/err") == 1 )) ||
  fail "launch did not warn once"
(( $(grep -c "^warning: train.out_dir '.*run' is on a file system without locks (.*ranks.lock: No locks available)" "$out/err") == 1 )) ||
  fail "the run did not warn once"
[[ -d $out/run/step_6 ]] || fail "no checkpoint"
echo "no locks: PASS"
