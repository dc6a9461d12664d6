# Two "hosts" on one machine, for multi-node tests: network namespaces joined by
# a veth pair. Sourced by the tests in tests/multinode (docs/cluster.md).
#
#   source bed.sh; bed_up WORK_DIR     two namespaces, a veth pair, /etc/hosts names,
#                                      the rsh agent; cleaned up on every exit (trap)
#   bed_mpirun NP ARGS...              mpirun started inside host A, NP ranks over A and B
#   bed_on HOST CMD...                 CMD inside one host
#   bed_link down|up                   the link between them
#   bed_pids HOST [PATTERN]            processes inside one host (pgrep -f PATTERN)
#
# After bed_up: BED_A, BED_B (host names = namespace names), BED_SUBNET, BED_AGENT.
# Names are unique per run (the shell's pid), so parallel ctest jobs never collide.
# Exit 77 (ctest's SKIP_RETURN_CODE) without root, without `ip netns` rights or mpirun.

bed_skip() { echo "SKIP: $*"; exit 77; }

bed_up() {
  local work=$1
  [ "$(id -u)" -eq 0 ] || bed_skip "network namespaces need root"
  command -v ip >/dev/null || bed_skip "no 'ip' command (iproute2)"
  command -v mpirun >/dev/null || bed_skip "no mpirun"
  local id=$$
  BED_A=mt${id}a BED_B=mt${id}b
  # A /24 out of 10.200.0.0/13, picked by the pid: two runs differ unless their pids are 2048 apart.
  BED_SUBNET=10.$((200 + id / 256 % 8)).$((id % 256))
  BED_WORK=$work
  mkdir -p "$work"
  trap bed_down EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  ip netns add "$BED_A" 2>/dev/null || bed_skip "'ip netns add' is not permitted here"
  ip netns add "$BED_B" || bed_fail_setup "ip netns add $BED_B"
  BED_UP=1
  # One veth pair, one end in each namespace; the addresses exist only inside them.
  ip link add "${BED_A}0" type veth peer name "${BED_B}0" || bed_fail_setup "ip link add veth"
  ip link set "${BED_A}0" netns "$BED_A" && ip link set "${BED_B}0" netns "$BED_B" ||
    bed_fail_setup "moving the veth ends"
  local ns n=1
  for ns in "$BED_A" "$BED_B"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$BED_SUBNET.$n/24" dev "${ns}0"
    ip -n "$ns" link set "${ns}0" up
    n=$((n + 1))
  done
  # Names for the test's duration; several beds may edit /etc/hosts at once, hence the lock.
  BED_HOSTS_MARK="# meshtrain test bed $id"
  (
    flock 9
    printf '%s.1 %s %s\n%s.2 %s %s\n' "$BED_SUBNET" "$BED_A" "$BED_HOSTS_MARK" \
      "$BED_SUBNET" "$BED_B" "$BED_HOSTS_MARK" >>/etc/hosts
  ) 9>/run/meshtrain-hosts.lock
  # Open MPI starts the daemon on a remote host with `AGENT [opts] HOST COMMAND...`:
  # here that host is a namespace.
  BED_AGENT=$work/rsh_agent.sh
  cat >"$BED_AGENT" <<'AGENT'
#!/usr/bin/env bash
while [[ $1 == -* ]]; do shift; done
host=$1; shift
exec ip netns exec "$host" unshare --uts /bin/sh -c "hostname $host && $*"
AGENT
  chmod +x "$BED_AGENT"
  echo "bed: hosts $BED_A ($BED_SUBNET.1) and $BED_B ($BED_SUBNET.2)"
}

bed_fail_setup() { echo "FAIL: test bed: $*"; exit 1; }

# Every exit path: kill what runs inside the namespaces (ranks, orted), delete them, the names.
bed_down() {
  local rc=$?
  if [ -n "${BED_UP:-}" ]; then
    local ns
    for ns in "$BED_A" "$BED_B"; do
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    done
    sleep 0.2
    for ns in "$BED_A" "$BED_B"; do
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
      ip netns del "$ns" 2>/dev/null
    done
    BED_UP=
  fi
  if [ -n "${BED_HOSTS_MARK:-}" ]; then
    (
      flock 9
      grep -vF "$BED_HOSTS_MARK" /etc/hosts >/etc/hosts.meshtrain.$$ || true
      cat /etc/hosts.meshtrain.$$ >/etc/hosts # in place: /etc/hosts may be a bind mount
      rm -f /etc/hosts.meshtrain.$$
    ) 9>/run/meshtrain-hosts.lock
    BED_HOSTS_MARK=
  fi
  exit "$rc"
}

# The MCA settings a multi-host Open MPI job needs here (docs/cluster.md says why).
bed_mca() {
  BED_MCA=(--mca plm_rsh_agent "$BED_AGENT"
           --mca btl tcp,vader,self
           --mca btl_tcp_if_include "$BED_SUBNET.0/24"
           --mca oob_tcp_if_include "$BED_SUBNET.0/24"
           --mca mpi_yield_when_idle 1)
}

# bed_mpirun NP ARGS...: NP ranks, the first half on host A, the rest on host B (by slot);
# mpirun is stopped after BED_TIMEOUT seconds (default 120).
bed_mpirun() {
  local np=$1; shift
  local half=$(((np + 1) / 2))
  bed_mca
  bed_on "$BED_A" timeout "${BED_TIMEOUT:-120}" mpirun --allow-run-as-root --oversubscribe -np "$np" \
    --host "$BED_A:$half,$BED_B:$((np - half))" "${BED_MCA[@]}" "$@"
}

# bed_on HOST CMD...: CMD inside HOST: its network namespace and its own host name
# (Open MPI names shared-memory segments by host name; the hosts must not share one).
bed_on() {
  local host=$1; shift
  ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

bed_link() {
  ip -n "$BED_A" link set "${BED_A}0" "$1" && ip -n "$BED_B" link set "${BED_B}0" "$1"
}

# bed_pids HOST [PATTERN]: pids inside HOST's namespace (whose command line matches PATTERN).
bed_pids() {
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null); do
    if [ -z "${2:-}" ] || tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2"; then
      echo "$pid"
    fi
  done
}
