#!/usr/bin/env bash
# What a killed run leaves is cleaned on restart: rank 0 is killed (SIGKILL)
# just before it commits the step-6 checkpoint of a dp 2 ZeRO-1 run with its
# optimizer state on disk, leaving step_6.tmp and both ranks' offload files;
# under launch the relaunch removes the stale offload files (by the run's
# prefix; a file of another run in the same directory stays), the next save
# removes the .tmp, and the result equals the uninterrupted run bit for bit.
# A partial last metrics line (a kill mid-write) is dropped on resume.
# usage: cleanup.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/common.sh" "$@"
zero=(--parallel.zero 1 --parallel.offload disk --parallel.offload_dir "$work/launch_cleanup/offload")
reference_run launch_cleanup 2 "${zero[@]}"
[[ -z $(ls "$out/offload") ]] || fail "a finished run left offload files: $(ls "$out/offload")"
touch "$out/offload/meshtrain-offload-0badc0de-zero_state.rank0-XXXXXX"  # another run's
# Attempt 1 only: the checkpoint fault point kills rank 0 before the rename.
cat >"$out/fault_once.sh" <<'SH'
#!/usr/bin/env bash
[[ $MESHTRAIN_LAUNCH_ATTEMPT == 1 ]] && export MESHTRAIN_CKPT_FAULT=before_rename@6
exec "$@"
SH
chmod +x "$out/fault_once.sh"
"$bin" launch --max-restarts 1 --backoff 0 -- "${mpirun[@]}" 2 "$out/fault_once.sh" "$bin" \
  $(train_args "$out/run") "${zero[@]}" >"$out/launch.log" 2>&1; rc=$?
grep -E "^launch:|stale|resume auto" "$out/launch.log"
(( rc == 0 )) || { cat "$out/launch.log"; fail "launch exited $rc"; }
grep -q '"exit_code":137' "$out/run/launch.jsonl" || fail "attempt 1 was not killed"
grep -q "resume auto: from .*/run/step_3$" "$out/launch.log" || fail "the kill did not hit the step-6 save (step_6 was committed)"
grep -q "^offload: removed 2 stale file(s) of this run" "$out/launch.log" ||
  fail "the relaunch did not remove the killed attempt's 2 offload files"
[[ $(ls "$out/offload") == meshtrain-offload-0badc0de-zero_state.rank0-XXXXXX ]] ||
  fail "offload dir holds: $(ls "$out/offload")"
ls -d "$out"/run/*.tmp 2>/dev/null && fail "a .tmp checkpoint directory survived"
same_checkpoint "$out/plain/step_36" "$out/run/step_36" || fail "result differs from the uninterrupted run"

# A partial last line in metrics.jsonl is cut off when the run resumes.
printf '{"step": 37, "lo' >>"$out/run/metrics.jsonl"
"${mpirun[@]}" 2 "$bin" $(train_args "$out/run") "${zero[@]}" --train.steps 38 --resume auto \
  >"$out/more.log" 2>&1 || { cat "$out/more.log"; fail "resume after a partial line failed"; }
python3 -c "
import json; [json.loads(l) for l in open('$out/run/metrics.jsonl')]" || fail "metrics.jsonl has a broken line"
echo "clean-up on restart: PASS"
