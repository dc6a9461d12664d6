#!/usr/bin/env bash
# `meshtrain ops test` refusals: a backend this build or machine cannot make
# (cuda without the toolkit at build time, or without a device) is one line and
# exit 8 (resource); an unknown backend, exit 1 naming it; an --op that
# matches nothing, exit 1; `ops nccl` without NCCL in the build or without a
# device, one SKIPPED line and exit 8. usage: refusals.sh MESHTRAIN
set -uo pipefail
bin=$1
fail() { echo "FAIL: $*"; exit 1; }
expect() {  # EXIT PATTERN [COMMAND] ARGS... (COMMAND: test unless given as nccl)
  local want=$1 pattern=$2 command=test; shift 2
  if [[ ${1:-} == nccl ]]; then command=nccl; shift; fi
  local err rc
  err=$("$bin" ops "$command" "$@" 2>&1 >/dev/null); rc=$?
  echo "ops $command $*: exit $rc: $err"
  (( rc == want )) || fail "exit $rc, not $want"
  (( $(printf '%s\n' "$err" | wc -l) == 1 )) || fail "not one line on stderr"
  [[ $err =~ $pattern ]] || fail "stderr does not match '$pattern'"
}
if nvidia-smi -L >/dev/null 2>&1; then
  echo "ops refusals: a GPU is present, the cuda refusal is not checked here"
else
  expect 8 "backend 'cuda' is not available: (this build has no CUDA backend|no CUDA device)" --backend cuda
  expect 8 "ops nccl: SKIPPED: (this build has no NCCL|no CUDA device)" nccl
fi
expect 1 "backend 'tpu' \(train.device, --backend\) is not one of: cpu, cuda" --backend tpu
expect 1 "no op matches --op 'no_such_op'" --op no_such_op
"$bin" ops test --list | grep -qx attention_backward || fail "--list lacks attention_backward"
echo "ops refusals: PASS"
