#!/usr/bin/env bash
# One bad-input case of the meshtrain CLI.
# usage: run_case.sh EXPECTED_RC REGEX -- COMMAND...
# Passes when COMMAND exits with EXPECTED_RC (not a crash) and writes exactly
# one line to stderr, matching the extended regex REGEX.
set -uo pipefail
expected_rc=$1 regex=$2
shift 3
err=$(mktemp)
"$@" >/dev/null 2>"$err"
rc=$?
lines=$(wc -l <"$err")
msg=$(cat "$err")
rm -f "$err"
echo "exit code: $rc; stderr: $msg"
if [ "$rc" -ne "$expected_rc" ]; then echo "FAIL: expected exit code $expected_rc"; exit 1; fi
if [ "$lines" -ne 1 ]; then echo "FAIL: expected one line on stderr, got $lines"; exit 1; fi
if ! grep -Eq -- "$regex" <<<"$msg"; then echo "FAIL: stderr does not match: $regex"; exit 1; fi
echo PASS
