#!/usr/bin/env bash
# Proves that the README's two commands work on a fresh Debian 12 machine: makes a
# minimal Debian 12 root (debootstrap --variant=minbase bookworm), clones the committed
# HEAD of this checkout into it, and runs there, in a chroot as root, `apt-get update`,
# `bash scripts/main_job.sh` and `bash scripts/test.sh`. Prints the stage that failed
# (exit 1) or a summary with timings. Needs root, the network this host uses for Debian's
# packages and PyPI, a few GB of disk and 20-30 minutes on 2 cores.
#
# Usage: scripts/check_fresh_machine.sh [--keep] [--reuse-base] [--root DIR] [--cache DIR]
#   --keep        leave the root in place afterwards (for debugging; it says where)
#   --reuse-base  start from the cached tarball of a pristine debootstrap instead of
#                 running debootstrap again (made by every run; saves a few minutes)
#   --root DIR    build the root in DIR (must not exist; default: a new dir in /var/tmp)
#   --cache DIR   where the base tarball is kept (default /var/cache/meshtrain-fresh)
# The clone stands alone: nothing is laid beside it, as for a user who clones the project.
# What the host uses to reach the package registries is carried into the root: its
# Debian sources and apt settings (Acquire::*), its pip configuration and PIP_* variables,
# proxy variables, and the CA bundle pip trusts, kept at a separate path from the root's
# own CA store (installing ca-certificates rewrites /etc/ssl/certs).
set -euo pipefail

KEEP=0 REUSE=0 ROOT="" CACHE=/var/cache/meshtrain-fresh
while (($#)); do
  case $1 in
    --keep) KEEP=1 ;;
    --reuse-base) REUSE=1 ;;
    --root) ROOT=$2; shift ;;
    --cache) CACHE=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "check_fresh_machine: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

SRC=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "check_fresh_machine: run as root (debootstrap, chroot, mount)" >&2; exit 2; }
git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1 \
  || { echo "check_fresh_machine: $SRC is not a git checkout" >&2; exit 2; }
COMMIT=$(git -C "$SRC" rev-parse HEAD)
if [ -n "$(git -C "$SRC" status --porcelain --untracked-files=no)" ]; then
  echo "check_fresh_machine: note: uncommitted changes in $SRC are not tested (HEAD $COMMIT is)" >&2
fi

# ---- stages and timings --------------------------------------------------------------
declare -a STAGE_NAMES=() STAGE_TIMES=() STAGE_RESULTS=()
T0=$SECONDS CURRENT="" STAGE_PID=""
stage() {  # stage NAME COMMAND...: runs it, records its time, stops everything on failure
  CURRENT=$1; shift
  echo
  echo "==== check_fresh_machine: $CURRENT ($(date -u +%H:%M:%S) UTC)"
  local t=$SECONDS rc=0
  # In a subshell with errexit in force (a function called left of || would run without it),
  # in the background so that a signal's trap runs at once (and ends it) instead of after it.
  set +e; (set -e; "$@") & STAGE_PID=$!; wait "$STAGE_PID"; rc=$?; set -e; STAGE_PID=""
  STAGE_NAMES+=("$CURRENT") STAGE_TIMES+=($((SECONDS - t)))
  if ((rc)); then
    STAGE_RESULTS+=("FAILED (exit $rc)")
    summary
    echo "check_fresh_machine: FAILED at stage '$CURRENT' (exit $rc)"
    CURRENT=""
    exit 1
  fi
  STAGE_RESULTS+=(ok)
  CURRENT=""
}
summary() {
  echo
  echo "==== check_fresh_machine: summary (commit ${COMMIT:0:12}, root $ROOT)"
  local i
  for i in "${!STAGE_NAMES[@]}"; do
    printf '  %-34s %-18s %4dm%02ds\n' "${STAGE_NAMES[$i]}" "${STAGE_RESULTS[$i]}" \
      $((STAGE_TIMES[i] / 60)) $((STAGE_TIMES[i] % 60))
  done
  printf '  %-34s %-18s %4dm%02ds\n' total "" $(((SECONDS - T0) / 60)) $(((SECONDS - T0) % 60))
}

# ---- the root, and cleaning up on every exit path ------------------------------------
if [ -z "$ROOT" ]; then
  ROOT=$(mktemp -d /var/tmp/meshtrain-fresh.XXXXXX)
else
  [ -e "$ROOT" ] && { echo "check_fresh_machine: $ROOT exists; give a new path" >&2; exit 2; }
  mkdir -p "$ROOT"; ROOT=$(cd "$ROOT" && pwd)
fi
chmod 755 "$ROOT"  # it is /, and mktemp made it 0700 (apt's _apt user could not read its lists)
ENV_FILE=$(mktemp /tmp/meshtrain-fresh-env.XXXXXX)  # the chroot's environment, one VAR=value a line
MOUNTS=()
unmount_all() {
  local i m
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    m=${MOUNTS[$i]}
    mountpoint -q "$m" && { umount -R "$m" 2>/dev/null || umount -l "$m"; }
  done
  MOUNTS=()
  # What the tests mounted inside the root themselves (ip netns: /run/netns), deepest first.
  findmnt -rn -o TARGET | grep "^$ROOT/" | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
}
kill_tree() {  # kill_tree PID: the stage's processes (those in the chroot too), leaves first
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$child"; done
  kill -TERM "$1" 2>/dev/null || true
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$CURRENT" ]; then
    echo "check_fresh_machine: stopped during stage '$CURRENT'" >&2
    [ -n "$STAGE_PID" ] && { kill_tree "$STAGE_PID"; sleep 2; }
  fi
  unmount_all
  rm -f "$ENV_FILE"
  if ((KEEP)); then
    echo "check_fresh_machine: root kept at $ROOT (chroot $ROOT bash; the clone is /work/meshtrain)"
  elif findmnt -rn -o TARGET | grep -q "^$ROOT\(/\|$\)"; then
    echo "check_fresh_machine: something is still mounted under $ROOT; not removing it" >&2
  else
    rm -rf --one-file-system "$ROOT"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- stage: a pristine minbase root ----------------------------------------------------
# The Debian mirror this host's apt uses (first deb/URIs entry of a Debian archive).
host_mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    sed -n -e 's/^[[:space:]]*URIs:[[:space:]]*\([^[:space:]]*\/debian\/\{0,1\}\)$/\1/p' \
           -e 's/^[[:space:]]*deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]\{1,\}\)\{0,1\}\([^[:space:]]*\/debian\/\{0,1\}\)[[:space:]].*/\2/p' "$f"
  done | head -n1
}
MIRROR=$(host_mirror)
[ -n "$MIRROR" ] || { echo "check_fresh_machine: no Debian mirror found in /etc/apt/sources.list*" >&2; exit 2; }
BASE_TAR=$CACHE/bookworm-minbase.tar

make_base() {
  if ((REUSE)) && [ -s "$BASE_TAR" ]; then
    echo "extracting the cached pristine debootstrap $BASE_TAR"
    tar -xpf "$BASE_TAR" -C "$ROOT"
    chmod 755 "$ROOT"
    return
  fi
  if ! command -v debootstrap >/dev/null; then
    echo "installing debootstrap on the host"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  echo "debootstrap --variant=minbase bookworm from $MIRROR"
  debootstrap --variant=minbase bookworm "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 \
    || { tail -n 30 "$ROOT.debootstrap.log"; rm -f "$ROOT.debootstrap.log"; return 1; }
  rm -f "$ROOT.debootstrap.log" "$ROOT"/var/cache/apt/archives/*.deb
  mkdir -p "$CACHE"
  tar -cpf "$BASE_TAR.tmp.$$" -C "$ROOT" . && mv "$BASE_TAR.tmp.$$" "$BASE_TAR"
  echo "cached the pristine root as $BASE_TAR"
}
stage "minbase root" make_base

# ---- stage: the host's way to the registries, into the root ------------------------------
printf '%s\n' HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  "TERM=${TERM:-dumb}" "LANG=${LANG:-C.UTF-8}" DEBIAN_FRONTEND=noninteractive \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 >"$ENV_FILE"
HOST_CA_DIR=/etc/meshtrain-host-ca   # inside the root, apart from /etc/ssl/certs
carry_bundle() {  # carry_bundle HOST_PATH: copies a CA bundle into the root, prints its new path
  local dst
  dst="$HOST_CA_DIR/$(printf '%s' "$1" | tr '/' '_' | sed 's/^_//')"
  mkdir -p "$ROOT$HOST_CA_DIR"
  cp -L "$1" "$ROOT$dst"
  printf '%s' "$dst"
}
configure_root() {
  # Name resolution as on the host.
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
  cp -L /etc/hosts "$ROOT/etc/hosts"
  # Debian sources: the host's files that use the same mirror (suites, security, updates).
  local f copied=0
  rm -f "$ROOT/etc/apt/sources.list"
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && grep -qF "$MIRROR" "$f" || continue
    cp "$f" "$ROOT/etc/apt/${f#/etc/apt/}"; copied=1
    echo "apt sources: ${f}"
  done
  ((copied)) || echo "deb $MIRROR bookworm main" >"$ROOT/etc/apt/sources.list"
  # apt's network settings (proxy, Acquire::*), not the host's hooks (Invoke) or its cleaning.
  for f in /etc/apt/apt.conf /etc/apt/apt.conf.d/*; do
    [ -f "$f" ] && grep -q 'Acquire' "$f" && ! grep -q 'Invoke' "$f" || continue
    cp "$f" "$ROOT/etc/apt/${f#/etc/apt/}"
    echo "apt config: $f"
  done
  # No services start inside the root.
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"; chmod +x "$ROOT/usr/sbin/policy-rc.d"

  # Proxy variables, as the host has them.
  local v
  for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY all_proxy ALL_PROXY; do
    [ -n "${!v:-}" ] || continue
    echo "$v=${!v}" >>"$ENV_FILE"; echo "env: $v"
  done
  # pip: the host's configuration files and PIP_* variables, with every CA bundle (and a
  # local find-links folder) carried along. CA variables other tools read go the same way.
  local cfg key val new
  for cfg in /etc/pip.conf /etc/xdg/pip/pip.conf /root/.config/pip/pip.conf /root/.pip/pip.conf; do
    [ -f "$cfg" ] || continue
    mkdir -p "$ROOT$(dirname "$cfg")"
    cp "$cfg" "$ROOT$cfg"
    while IFS= read -r val; do
      [ -f "$val" ] || continue
      new=$(carry_bundle "$val")
      sed -i "s#^\([[:space:]]*cert[[:space:]]*=[[:space:]]*\)${val}[[:space:]]*\$#\1$new#" "$ROOT$cfg"
    done < <(sed -n 's/^[[:space:]]*cert[[:space:]]*=[[:space:]]*\([^[:space:]]*\).*/\1/p' "$cfg")
    echo "pip config: $cfg"
  done
  while IFS='=' read -r key val; do
    case $key in
      PIP_CERT|PIP_CLIENT_CERT|SSL_CERT_FILE|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|GIT_SSL_CAINFO)
        [ -f "$val" ] && val=$(carry_bundle "$val") ;;
      PIP_FIND_LINKS)
        [ -d "$val" ] && mkdir -p "$ROOT$val" && cp -a "$val/." "$ROOT$val/" ;;
      PIP_*) ;;
      *) continue ;;
    esac
    echo "$key=$val" >>"$ENV_FILE"
    echo "env: $key=$val"
  done < <(env | grep -E '^(PIP_[A-Z_]*|SSL_CERT_FILE|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|GIT_SSL_CAINFO)=')
  # The clone of the committed HEAD, alone in its folder.
  mkdir -p "$ROOT/work"
  git clone -q --no-checkout "$SRC" "$ROOT/work/meshtrain"
  git -C "$ROOT/work/meshtrain" checkout -q --detach "$COMMIT"
  echo "cloned $SRC at $COMMIT into /work/meshtrain"
}
stage "configure root + clone" configure_root

# ---- the chroot ---------------------------------------------------------------------------
bind() {  # bind SRC DIR-IN-ROOT
  mkdir -p "$ROOT$2"
  mount --bind "$1" "$ROOT$2"
  MOUNTS+=("$ROOT$2")
}
bind /proc /proc
bind /sys /sys
# The cgroup hierarchy (slurmd's cgroup plugin needs it), with its sub-mounts.
if mountpoint -q /sys/fs/cgroup; then
  mount --rbind /sys/fs/cgroup "$ROOT/sys/fs/cgroup" && mount --make-rslave "$ROOT/sys/fs/cgroup"
  MOUNTS+=("$ROOT/sys/fs/cgroup")
fi
bind /dev /dev
bind /dev/pts /dev/pts
mountpoint -q /dev/shm && bind /dev/shm /dev/shm
in_root() {  # in_root COMMAND: runs a bash command in the root, in the clone, with a clean env
  local chroot_env; mapfile -t chroot_env <"$ENV_FILE"
  chroot "$ROOT" /usr/bin/env -i "${chroot_env[@]}" /bin/bash -c "cd /work/meshtrain && $1"
}

stage "apt-get update" in_root "apt-get update"
# The main job first: its stage is a new user's way to a trained model (packages, the build of
# meshtrain alone, the data, training, sampling) on a machine that has nothing yet.
stage "README: bash scripts/main_job.sh" in_root "bash scripts/main_job.sh"
stage "README: bash scripts/test.sh" in_root "bash scripts/test.sh"
# setup.sh runs on every CI and main-job run: once everything is there it must be quick.
stage "setup.sh again (idempotent)" in_root "bash scripts/setup.sh build >/dev/null"

summary
echo "check_fresh_machine: PASSED: both README commands work on a fresh Debian 12 root"
