# A one-node Slurm cluster, started by hand for a test: munged, slurmctld -D and
# slurmd -D on a generated slurm.conf in a temp dir (its own ports, state, spool, logs
# and munge socket), stopped and removed on every exit path. Sourced by tests/slurm.
#
#   source bed.sh; slurm_up WORK_DIR   then srun / sbatch / sinfo talk to it (SLURM_CONF)
#
# Exit 77 (ctest's SKIP_RETURN_CODE) without root or without the packages
# (munge slurmctld slurmd slurm-client: scripts/setup.sh).

slurm_skip() { echo "SKIP: $*"; exit 77; }
slurm_fail_setup() {
  echo "FAIL: Slurm test bed: $*"
  local f
  for f in "$SLURM_BED"/*.log; do [ -s "$f" ] && { echo "--- $f"; tail -20 "$f"; }; done
  exit 1
}

slurm_up() {
  [ "$(id -u)" -eq 0 ] || slurm_skip "the Slurm test bed runs its daemons as root"
  local tool
  for tool in munged slurmctld slurmd srun sbatch sinfo scontrol; do
    command -v "$tool" >/dev/null || slurm_skip "no $tool (packages munge slurmctld slurmd slurm-client)"
  done
  SLURM_BED=$1
  rm -rf "$SLURM_BED"
  mkdir -p "$SLURM_BED"/{state,spool,munge}
  chmod 711 "$SLURM_BED/munge"
  SLURM_BED_PIDS=()
  trap slurm_down EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  # munged with its own key and socket (the system's, if any, is left alone).
  dd if=/dev/urandom of="$SLURM_BED/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$SLURM_BED/munge/munge.key"
  local sock=$SLURM_BED/munge/munge.socket
  munged -F -f --socket="$sock" --key-file="$SLURM_BED/munge/munge.key" \
    --pid-file="$SLURM_BED/munge/munged.pid" --seed-file="$SLURM_BED/munge/munged.seed" \
    --log-file="$SLURM_BED/munged.log" >>"$SLURM_BED/munged.log" 2>&1 &
  SLURM_BED_PIDS+=($!)
  # Ports from the pid (a 3-port block in 17000..46999), moved on while one is taken.
  local base=$((17000 + $$ % 10000 * 3)) tries
  for tries in 1 2 3 4 5 6 7 8; do
    ! (exec 3<>/dev/tcp/127.0.0.1/$base) 2>/dev/null &&
      ! (exec 3<>/dev/tcp/127.0.0.1/$((base + 1))) 2>/dev/null && break
    base=$((base + 3))
  done
  local host node=mt$$n cpus
  host=$(hostname -s)
  cpus=$(nproc); [ "$cpus" -lt 4 ] && cpus=4 # srun -n 4 on a 2-core machine
  export SLURM_CONF=$SLURM_BED/slurm.conf
  cat >"$SLURM_CONF" <<CONF
ClusterName=mt$$
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$base
SlurmdPort=$((base + 1))
SrunPortRange=$((base + 2))-$((base + 2))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$SLURM_BED/state
SlurmdSpoolDir=$SLURM_BED/spool
SlurmctldPidFile=$SLURM_BED/slurmctld.pid
SlurmdPidFile=$SLURM_BED/slurmd.pid
SlurmctldLogFile=$SLURM_BED/slurmctld.log
SlurmdLogFile=$SLURM_BED/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  # Wait for munged's socket before the Slurm daemons need it.
  local i
  for i in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done
  [ -S "$sock" ] || slurm_fail_setup "munged did not start"
  slurmctld -D -i -f "$SLURM_CONF" >>"$SLURM_BED/slurmctld.out" 2>&1 &
  SLURM_BED_PIDS+=($!)
  slurmd -D -N "$node" -f "$SLURM_CONF" >>"$SLURM_BED/slurmd.out" 2>&1 &
  SLURM_BED_PIDS+=($!)
  for i in $(seq 150); do
    [ "$(sinfo -h -n "$node" -o %t 2>/dev/null)" = idle ] && break
    sleep 0.2
  done
  [ "$(sinfo -h -n "$node" -o %t 2>/dev/null)" = idle ] ||
    slurm_fail_setup "node $node not idle after 30 s: $(sinfo -h -o '%t %E' 2>&1)"
  echo "slurm: cluster mt$$ (node $node, ports $base-$((base + 2)), $cpus CPUs) in $SLURM_BED"
}

# slurm_job_pids [NAME]: the bed's job steps and tasks (slurmstepd daemonizes, so they are
# not below slurmd): processes with this bed's SLURM_CONF in their environment that are a
# slurmstepd or carry a SLURM_JOB_ID; with NAME, only those whose process name is NAME.
slurm_job_pids() {
  local dir pid env comm
  for dir in /proc/[0-9]*; do
    pid=${dir#/proc/}
    [ "$pid" = "$$" ] && continue
    env=$(tr '\0' '\n' 2>/dev/null <"$dir/environ") || continue
    grep -qxF "SLURM_CONF=$SLURM_CONF" <<<"$env" || continue
    comm=$(cat "$dir/comm" 2>/dev/null)
    [ "$comm" = slurmstepd ] || grep -q "^SLURM_JOB_ID=" <<<"$env" || continue
    [ -z "${1:-}" ] || [ "$comm" = "$1" ] && echo "$pid"
  done
}

# Every exit path: cancel what is left, kill the job steps still there, stop the daemons
# (slurmd first), then munged.
slurm_down() {
  local rc=$?
  if [ -n "${SLURM_BED_PIDS:-}" ]; then
    scancel --full --quiet "--clusters=mt$$" 2>/dev/null || scancel --full --quiet -u root 2>/dev/null
    local i pid left
    left=$(slurm_job_pids)
    [ -n "$left" ] && kill -9 $left 2>/dev/null
    for ((i = ${#SLURM_BED_PIDS[@]} - 1; i >= 0; i--)); do
      pid=${SLURM_BED_PIDS[i]}
      kill "$pid" 2>/dev/null && { timeout 10 tail --pid="$pid" -f /dev/null || kill -9 "$pid" 2>/dev/null; }
    done
    SLURM_BED_PIDS=()
  fi
  exit "$rc"
}
