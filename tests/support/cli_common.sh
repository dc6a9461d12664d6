# Sourced by the multi-rank CLI tests with their arguments,
#   MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
# (the prefix takes a rank count and the command): sets mpirun, bin and work,
# and defines fail.
mpirun=()
while [[ $1 != "--" ]]; do mpirun+=("$1"); shift; done
shift
bin=$1 work=$2
fail() { echo "FAIL: $*"; exit 1; }
# expect_error PATTERN CONFIG_FILE [ARGS...]: `train --config CONFIG_FILE ARGS` fails with exit
# EXIT (default 1: config; the error kind's code, docs/errors.md) and one stderr line matching
# PATTERN.
expect_error() {
  local rc=0 pattern=$1 config=$2
  shift 2
  "$bin" train --config "$config" "$@" >"$work/out" 2>"$work/err" || rc=$?
  [ "$rc" -eq "${EXIT:-1}" ] || fail "$config exited $rc, not ${EXIT:-1}: $(cat "$work/err")"
  [ "$(wc -l <"$work/err")" -eq 1 ] || fail "$config: not one line on stderr: $(cat "$work/err")"
  grep -qE "$pattern" "$work/err" || fail "$config: '$(cat "$work/err")' does not match '$pattern'"
  echo "ok: $(cat "$work/err")"
}
