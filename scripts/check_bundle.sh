#!/usr/bin/env bash
# Proves the engine's bundle (scripts/gpu_bundle.sh) needs nothing beside it:
# unpacks it into a pristine Debian root (the minbase tarball
# scripts/check_fresh_machine.sh caches; no Open MPI, no oneDNN, no compiler)
# and trains llama-tiny for 6 steps there on the CPU. Needs root (chroot).
# usage: sudo bash scripts/check_bundle.sh [BASE_TAR]
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-/var/cache/meshtrain-fresh/bookworm-minbase.tar}
[[ -f build/gpu-bundle.tar.xz ]] || { echo "check_bundle: run scripts/gpu_bundle.sh first" >&2; exit 1; }
[[ -f $base ]] || { echo "check_bundle: $base not found (scripts/check_fresh_machine.sh makes it)" >&2; exit 1; }
root=$(mktemp -d /tmp/bundle-root.XXXXXX)
cleanup() {
  umount "$root/proc" 2>/dev/null || true
  mountpoint -q "$root/proc" || rm -rf "$root"  # never delete through a mounted /proc
}
trap cleanup EXIT
tar -xf "$base" -C "$root"
mkdir -p "$root/work"
tar -xJf build/gpu-bundle.tar.xz -C "$root/work"
sed -e 's#data/kjv/bytes#/work/gpu-bundle/data/bytes#' -e 's#^out_dir = .*#out_dir = "/work/run"#' \
  configs/llama-tiny-bytes.toml > "$root/work/tiny.toml"
mount -t proc proc "$root/proc"
chroot "$root" /work/gpu-bundle/meshtrain train --config /work/tiny.toml --train.steps 6 \
  --train.eval_interval 3 --train.log_interval 2 | grep -E '^step|checkpoint'
[[ -d $root/work/run/step_6 ]]
echo "check_bundle: PASS (trained in a root with nothing but the bundle)"
