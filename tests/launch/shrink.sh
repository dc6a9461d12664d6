#!/usr/bin/env bash
# --shrink: rank 3 of a dp 4 run is killed while saving step 6, in the first
# two attempts; after the second failure naming rank 3, launch relaunches
# with 2 ranks (dp 2: the largest divisor of batch_size 8 below 4); the
# checkpoint reshards on load and the run finishes, its losses matching the
# uninterrupted dp 4 run within float tolerance (another reduction order).
# usage: shrink.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/common.sh" "$@"
reference_run launch_shrink 4
cat >"$out/fault_rank3.sh" <<'SH'
#!/usr/bin/env bash
[[ $MESHTRAIN_LAUNCH_ATTEMPT -le 2 && $OMPI_COMM_WORLD_RANK == 3 ]] && export MESHTRAIN_CKPT_FAULT=before_file@6
exec "$@"
SH
chmod +x "$out/fault_rank3.sh"
"$bin" launch --shrink --shrink-after 2 --max-restarts 3 --backoff 0 -- "${mpirun[@]}" 4 \
  "$out/fault_rank3.sh" "$bin" $(train_args "$out/run") >"$out/launch.log" 2>&1; rc=$?
grep "^launch:" "$out/launch.log" | cut -c1-200
(( rc == 0 )) || { cat "$out/launch.log"; fail "launch exited $rc"; }
python3 - "$out/plain" "$out/run" <<'PY' || fail "shrink"
import json, sys
plain, run = sys.argv[1:]
log = [json.loads(l) for l in open(f"{run}/launch.jsonl")]
ends = [e for e in log if e["event"] == "end"]
assert [(e["exit_code"], e["failing_rank"]) for e in ends] == [(137, 3), (137, 3), (0, -1)], ends
shrink = [e for e in log if e["event"] == "shrink"]
assert len(shrink) == 1 and (shrink[0]["from_ranks"], shrink[0]["to_ranks"]) == (4, 2), shrink
starts = [e for e in log if e["event"] == "start"]
assert "4" in starts[1]["command"] and "2" in starts[2]["command"], starts
def losses(d):
    out = {}
    for r in map(json.loads, open(f"{d}/metrics.jsonl")):
        if "loss" in r:
            out[r["step"]] = r["loss"]  # the last record of a step: the run that continued
    return out
a, b = losses(plain), losses(run)
assert sorted(a) == sorted(b) == list(range(1, 37))
worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
assert worst < 1e-4, worst
print(f"4 -> 2 ranks after two failures of rank 3; losses within {worst:.1e} of the dp 4 run")
PY
echo "shrink under launch: PASS"
