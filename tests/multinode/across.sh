#!/usr/bin/env bash
# Runs one MPI command across two namespace hosts (tests/multinode/bed.sh):
# NP ranks, the first half on host A, the rest on host B; the bed is removed afterwards.
# usage: across.sh NP [MPIRUN_OPTION...] -- COMMAND...
#   e.g. across.sh 2 -- build/meshtrain bench comm --quick
# Exit: the command's status; 77 where the bed cannot be made (not root, no `ip netns`).
set -uo pipefail
source "$(dirname "$0")/bed.sh"
np=$1; shift
opts=()
while [[ $# -gt 0 && $1 != "--" ]]; do opts+=("$1"); shift; done
[[ ${1:-} == "--" ]] || { echo "usage: across.sh NP [MPIRUN_OPTION...] -- COMMAND..." >&2; exit 2; }
shift
work=$(mktemp -d /tmp/meshtrain-bed.XXXXXX)
bed_up "$work"
bed_mpirun "$np" "${opts[@]}" "$@"
rc=$?
rm -rf "$work"
exit "$rc"
