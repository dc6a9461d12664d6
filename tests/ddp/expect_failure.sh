#!/usr/bin/env bash
# Runs a command that must fail: a non-zero exit within MAX_SECONDS, and
# every PATTERN (grep -E) found in its combined output, each exactly once.
# usage: expect_failure.sh MAX_SECONDS PATTERN... -- COMMAND...
set -uo pipefail
max=$1
shift
patterns=()
while [[ $# -gt 0 && $1 != "--" ]]; do
  patterns+=("$1")
  shift
done
shift
start=$(date +%s%N)
out=$("$@" 2>&1)
rc=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
ok=1
if [[ $rc -eq 0 ]]; then
  echo "FAIL: exit code 0, expected a failure"
  ok=0
fi
if ((elapsed_ms > max * 1000)); then
  echo "FAIL: took ${elapsed_ms} ms, more than ${max} s"
  ok=0
fi
for p in "${patterns[@]}"; do
  n=$(grep -cE -- "$p" <<<"$out")
  if [[ $n -ne 1 ]]; then
    echo "FAIL: pattern '$p' found $n times, expected once"
    ok=0
  fi
done
echo "exit $rc after ${elapsed_ms} ms; output:"
echo "$out"
[[ $ok -eq 1 ]]
