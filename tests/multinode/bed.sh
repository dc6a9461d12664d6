# Two "hosts" on one machine, for multi-node tests: network namespaces joined by a
# veth pair, each with its own host name. Sourced by tests/multinode (docs/cluster.md).
#
#   source bed.sh; bed_up WORK_DIR   two namespaces, a veth pair, /etc/hosts names, the
#                                    rsh agent, WORK_DIR/mpirun; all removed on every exit
#   bed_mpirun NP ARGS...            mpirun inside host A: NP ranks, the first half on A
#   WORK_DIR/mpirun ARGS...          the same mpirun without a host list or time limit
#                                    (a plain command, for `meshtrain launch -- ...`)
#   bed_on HOST CMD...               CMD inside one host
#   bed_link down|up                 the link between them
#   bed_pids HOST [NAME]             processes inside one host (named NAME: meshtrain, orted)
#
# After bed_up: BED_A, BED_B (host = namespace names), BED_SUBNET (a /24 prefix),
# BED_MPIRUN (WORK_DIR/mpirun). Names are unique per run (the shell's pid), so parallel
# ctest jobs never collide. Exit 77 (ctest's SKIP_RETURN_CODE) without root, without
# `ip netns` rights, without unshare or mpirun.
#
# Settings (environment): BED_TIMEOUT (bed_mpirun's limit, s; 120), BED_TCP_RETRIES2 (4),
# BED_KEEPALIVE (s before Open MPI's daemons probe an idle link; 10), BED_YIELD (Open MPI's
# mpi_yield_when_idle; 1): docs/cluster.md.

bed_skip() { echo "SKIP: $*"; exit 77; }
bed_fail_setup() { echo "FAIL: test bed: $*"; exit 1; }

bed_up() {
  local work=$1
  [ "$(id -u)" -eq 0 ] || bed_skip "network namespaces need root"
  local tool
  for tool in ip unshare mpirun; do
    command -v "$tool" >/dev/null || bed_skip "no $tool"
  done
  local id=$$
  BED_A=mt${id}a BED_B=mt${id}b
  # A /24 of 10.200.0.0/13 from the pid: two beds differ unless their pids are 2048 apart.
  BED_SUBNET=10.$((200 + id / 256 % 8)).$((id % 256))
  mkdir -p "$work" && work=$(readlink -f "$work")
  BED_WORK=$work
  trap bed_down EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  ip netns add "$BED_A" 2>/dev/null || bed_skip "'ip netns add' is not permitted here"
  BED_UP=1
  # In a chroot `ip netns add` may create the name but not the mount it needs.
  ip netns exec "$BED_A" true 2>/dev/null ||
    bed_skip "'ip netns exec' does not work here (a chroot whose / is not a mount point?)"
  ip netns add "$BED_B" || bed_fail_setup "ip netns add $BED_B"
  # One veth pair, one end in each namespace; the addresses exist only inside them.
  ip link add "${BED_A}0" type veth peer name "${BED_B}0" || bed_fail_setup "ip link add veth"
  ip link set "${BED_A}0" netns "$BED_A" && ip link set "${BED_B}0" netns "$BED_B" ||
    bed_fail_setup "moving the veth ends"
  local ns n=1
  for ns in "$BED_A" "$BED_B"; do
    ip -n "$ns" link set lo up &&
      ip -n "$ns" addr add "$BED_SUBNET.$n/24" dev "${ns}0" &&
      ip -n "$ns" link set "${ns}0" up || bed_fail_setup "addresses in $ns"
    # Unacknowledged data on a cut link fails the connection after ~6 s instead of ~15 min.
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_retries2="${BED_TCP_RETRIES2:-4}" ||
      bed_fail_setup "tcp_retries2 in $ns"
    n=$((n + 1))
  done
  # Names for the test's duration; beds in parallel edit /etc/hosts, hence the lock.
  BED_HOSTS_MARK="# meshtrain test bed $id"
  (
    flock 9
    printf '%s.1 %s %s\n%s.2 %s %s\n' "$BED_SUBNET" "$BED_A" "$BED_HOSTS_MARK" \
      "$BED_SUBNET" "$BED_B" "$BED_HOSTS_MARK" >>/etc/hosts
  ) 9>/run/meshtrain-hosts.lock
  # Open MPI starts its daemon on another host with `AGENT [opts] HOST COMMAND...`:
  # here a host is a namespace with its own host name (Open MPI names shared-memory
  # segments by host name: two hosts sharing one crash in MPI_Init).
  cat >"$work/rsh_agent" <<'AGENT'
#!/usr/bin/env bash
while [[ $1 == -* ]]; do shift; done
host=$1; shift
exec ip netns exec "$host" unshare --uts /bin/sh -c "hostname $host && $*"
AGENT
  local keepalive=${BED_KEEPALIVE:-10}
  BED_MPIRUN=$work/mpirun
  cat >"$BED_MPIRUN" <<WRAPPER
#!/usr/bin/env bash
# mpirun inside host $BED_A of the test bed (tests/multinode/bed.sh; settings: docs/cluster.md).
exec ip netns exec $BED_A unshare --uts /bin/sh -c 'hostname $BED_A && exec "\$@"' $BED_A \\
  mpirun --allow-run-as-root --oversubscribe \\
  --mca plm_rsh_agent $work/rsh_agent \\
  --mca btl tcp,vader,self \\
  --mca btl_tcp_if_include $BED_SUBNET.0/24 --mca oob_tcp_if_include $BED_SUBNET.0/24 \\
  --mca oob_tcp_keepalive_time $keepalive --mca oob_tcp_keepalive_intvl 1 \\
  --mca oob_tcp_keepalive_probes 3 \\
  --mca mpi_yield_when_idle ${BED_YIELD:-1} "\$@"
WRAPPER
  chmod +x "$work/rsh_agent" "$BED_MPIRUN"
  echo "bed: hosts $BED_A ($BED_SUBNET.1) and $BED_B ($BED_SUBNET.2)"
}

# Every exit path: kill what runs inside the namespaces (ranks, orted), delete them, the names.
bed_down() {
  local rc=$?
  if [ -n "${BED_UP:-}" ]; then
    local ns round
    for round in 1 2; do
      for ns in "$BED_A" "$BED_B"; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
      done
      sleep 0.2
    done
    for ns in "$BED_A" "$BED_B"; do ip netns del "$ns" 2>/dev/null; done
    BED_UP=
  fi
  if [ -n "${BED_HOSTS_MARK:-}" ]; then
    (
      flock 9
      grep -vF "$BED_HOSTS_MARK" /etc/hosts >"/etc/hosts.meshtrain.$$" || true
      cat "/etc/hosts.meshtrain.$$" >/etc/hosts # in place: /etc/hosts may be a bind mount
      rm -f "/etc/hosts.meshtrain.$$"
    ) 9>/run/meshtrain-hosts.lock
    BED_HOSTS_MARK=
  fi
  exit "$rc"
}

bed_on() {
  local host=$1; shift
  ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

# bed_mpirun NP ARGS...: NP ranks by slot, the first half on host A, the rest on host B;
# mpirun is stopped after BED_TIMEOUT seconds.
bed_mpirun() {
  local np=$1; shift
  local half=$(((np + 1) / 2))
  timeout "${BED_TIMEOUT:-120}" "$BED_MPIRUN" -np "$np" --host "$BED_A:$half,$BED_B:$((np - half))" "$@"
}

bed_link() {
  ip -n "$BED_A" link set "${BED_A}0" "$1" && ip -n "$BED_B" link set "${BED_B}0" "$1"
}

bed_pids() {
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null); do
    if [ -z "${2:-}" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
      echo "$pid"
    fi
  done
}
