#!/usr/bin/env bash
# The restart policy end to end: a config error is not retried; a failure
# that is retried stops with its code once --max-restarts are spent, with the
# back-off doubling; each attempt is one JSONL record with the cause line.
# usage: policy.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -uo pipefail
source "$(dirname "$0")/common.sh" "$@"
out=$work/launch_policy
rm -rf "$out" && mkdir -p "$out"

# A config error: one attempt, launch exits 1.
"$bin" launch --log "$out/config.jsonl" --backoff 0 -- "$bin" train --config "$work/good.toml" \
  --train.stepz 3 >"$out/config.log" 2>&1; rc=$?
cat "$out/config.log"
(( rc == 1 )) || fail "config error: launch exited $rc, not 1"
(( $(grep -c '"event":"start"' "$out/config.jsonl") == 1 )) || fail "a config error was retried"
grep -q "unknown key 'train.stepz'" "$out/config.jsonl" || fail "the cause line is not logged"

# A peer failure every time: 1 + 2 attempts, exit 6, back-off 0.1 then 0.2 s.
"$bin" launch --log "$out/peer.jsonl" --max-restarts 2 --backoff 0.1 -- \
  bash -c 'echo "rank 1: peer: the link went down" >&2; exit 6' >"$out/peer.log" 2>&1; rc=$?
cat "$out/peer.log"
(( rc == 6 )) || fail "spent restarts: launch exited $rc, not 6"
python3 - "$out/peer.jsonl" <<'PY' || fail "launch log"
import json, sys
log = [json.loads(l) for l in open(sys.argv[1])]
ends = [e for e in log if e["event"] == "end"]
assert [e["exit_code"] for e in ends] == [6, 6, 6], ends
assert all(e["kind"] == "peer" and e["failing_rank"] == 1 for e in ends), ends
assert all(e["cause"] == "rank 1: peer: the link went down" for e in ends), ends
assert [e["backoff_s"] for e in ends] == [0.1, 0.2, 0], ends
assert "restarts spent" in ends[-1]["action"], ends[-1]
assert log[-1] == {**log[-1], "event": "finish", "exit_code": 6, "restarts": 2}, log[-1]
PY
# A usage error of launch itself.
"$bin" launch --max-restarts -1 -- true >/dev/null 2>&1; (( $? == 2 )) || fail "bad --max-restarts is not a usage error"
echo "launch policy: PASS"
