#!/usr/bin/env bash
# Under a one-node Slurm started by hand (tests/slurm/bed.sh): `srun -n 2 --mpi=pmix
# meshtrain train` (dp 2) and the same srun inside `sbatch --wait` equal `mpirun -np 2`
# bit for bit (every rank's losses, gradient norms, validation losses; every checkpoint
# shard); and where `meshtrain launch` exists, `meshtrain launch -- srun ...` too.
# usage: srun_equals_mpirun.sh MESHTRAIN CLI_WORK_DIR (the CLI tests' inputs)
set -uo pipefail
here=$(dirname "$(readlink -f "$0")")
source "$here/bed.sh"
source "$here/../support/features.sh"
bin=$(readlink -f "$1") inputs=$(readlink -f "$2")
work=$inputs/slurm_dp2
rm -rf "$work"
fail() { echo "FAIL: $*"; exit 1; }
slurm_up "$work/cluster"
args=(train --config "$inputs/good.toml" --train.steps 4 --train.checkpoint_interval 0
      --train.eval_interval 2 --train.log_interval 1 --train.threads 1)
compare() { python3 "$here/../support/compare_runs.py" 2 4 "$work/mpirun" "$@"; }

timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" "${args[@]}" \
  --train.out_dir "$work/mpirun" >"$work/mpirun.log" 2>&1 || { cat "$work/mpirun.log"; fail "mpirun -np 2"; }

timeout 120 srun -n 2 --mpi=pmix "$bin" "${args[@]}" --train.out_dir "$work/srun" \
  >"$work/srun.log" 2>&1 || { cat "$work/srun.log"; fail "srun -n 2 --mpi=pmix"; }
grep -q "^parallel: dp 2 x tp 1 x pp 1 = 2 ranks" "$work/srun.log" || { cat "$work/srun.log"; fail "srun: not one job of 2 ranks"; }
compare "$work/srun" || fail "srun differs from mpirun"

# A batch script, as on a real cluster (docs/cluster.md).
cat >"$work/job.sh" <<JOB
#!/usr/bin/env bash
#SBATCH --job-name=meshtrain-test
#SBATCH --ntasks=2
#SBATCH --output=$work/sbatch.log
srun --mpi=pmix "$bin" ${args[*]} --train.out_dir "$work/sbatch"
JOB
timeout 120 sbatch --wait --quiet "$work/job.sh" || { cat "$work/sbatch.log"; fail "sbatch --wait"; }
compare "$work/sbatch" || fail "sbatch differs from mpirun"

# meshtrain launch around srun, once that command exists: a plain run, then one whose rank 1
# is killed (SIGKILL) after the first checkpoint: srun ends the step (--kill-on-bad-exit),
# launch relaunches it with --resume auto, and the run equals an uninterrupted mpirun run.
if has_subcommand "$bin" launch; then
  timeout 120 "$bin" launch --max-restarts 1 -- srun -n 2 --mpi=pmix "$bin" "${args[@]}" \
    --train.out_dir "$work/launch" >"$work/launch.log" 2>&1 || { cat "$work/launch.log"; fail "launch -- srun"; }
  compare "$work/launch" || fail "launch -- srun differs from mpirun"

  long=(train --config "$inputs/good.toml" --train.steps 200 --train.checkpoint_interval 20
        --train.eval_interval 0 --train.log_interval 1 --train.threads 1)
  timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" "${long[@]}" \
    --train.out_dir "$work/mpirun_long" >"$work/mpirun_long.log" 2>&1 || { cat "$work/mpirun_long.log"; fail "mpirun, 200 steps"; }
  timeout 180 "$bin" launch --max-restarts 2 --backoff 1 --log "$work/launch_kill.jsonl" -- \
    srun -n 2 --mpi=pmix --kill-on-bad-exit=1 "$bin" "${long[@]}" --train.out_dir "$work/launch_kill" \
    >"$work/launch_kill.log" 2>&1 &
  job=$!
  for _ in $(seq 600); do grep -qE "^step +25/" "$work/launch_kill.log" 2>/dev/null && break; sleep 0.1; done
  victim=$(for p in $(slurm_job_pids meshtrain); do
             tr '\0' '\n' <"/proc/$p/environ" | grep -qx SLURM_PROCID=1 && echo "$p"; done)
  [ -n "$victim" ] || { cat "$work/launch_kill.log"; fail "no task 1 of the step found"; }
  kill -9 "$victim"
  wait "$job" || { cat "$work/launch_kill.log"; fail "launch -- srun after a killed task"; }
  grep '"end"' "$work/launch_kill.jsonl" | head -1 | cut -c1-300
  [ "$(grep -c '"start"' "$work/launch_kill.jsonl")" -ge 2 ] || fail "launch did not relaunch the srun"
  python3 "$here/../support/compare_runs.py" 2 200 "$work/mpirun_long" "$work/launch_kill" ||
    fail "launch -- srun with a killed task differs from the uninterrupted mpirun run"
else
  echo "note: no 'meshtrain launch' in this build: launch -- srun not tested"
fi
echo "slurm srun/sbatch equal mpirun: PASS"
