# Sourced by the multi-rank CLI tests with their arguments,
#   MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
# (the prefix takes a rank count and the command): sets mpirun, bin and work,
# and defines fail.
mpirun=()
while [[ $1 != "--" ]]; do mpirun+=("$1"); shift; done
shift
bin=$1 work=$2
fail() { echo "FAIL: $*"; exit 1; }
