#!/usr/bin/env bash
# A full disk, for real (a small tmpfs): a checkpoint that does not fit ends
# the run with one line naming the file, non-zero, and leaves the previous
# checkpoint valid with `latest` naming it; a metrics write that does not fit
# ends the run naming the metrics file. Skips (77) where tmpfs cannot be mounted.
# usage: full_disk.sh MESHTRAIN WORK_DIR   (after make_inputs.sh)
set -uo pipefail
BIN=$1 WORK=$2
disk="$WORK/full_disk"
mkdir -p "$disk"
mount -t tmpfs -o size=2560k tmpfs "$disk" 2>/dev/null || { echo "SKIP: cannot mount tmpfs"; exit 77; }
trap 'umount "$disk"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# llama-tiny's checkpoint is ~1.5 MB: step 15's fits, step 30's does not.
"$BIN" train --config "$WORK/good.toml" --train.out_dir "$disk/run" >"$WORK/full_disk.log" 2>"$WORK/full_disk.err"
rc=$?
cat "$WORK/full_disk.err"
[ "$rc" -ne 0 ] || fail "training on a full disk exited 0"
[ "$(wc -l <"$WORK/full_disk.err")" -eq 1 ] || fail "expected one line on stderr"
grep -Eq '^meshtrain: .*(step_30|rank_0)' "$WORK/full_disk.err" || fail "the error does not name the checkpoint file"
[ "$(cat "$disk/run/latest")" = step_15 ] || fail "latest is not step_15: $(cat "$disk/run/latest" 2>&1)"
"$BIN" ckpt inspect --verify "$disk/run/step_15" >/dev/null || fail "step_15 does not verify"
[ ! -e "$disk/run/step_30" ] || fail "a partial step_30 exists"

# Metrics: leave a few hundred bytes free.
rm -rf "$disk/run"
avail=$(( $(stat -f -c '%a * %S' "$disk") ))
dd if=/dev/zero of="$disk/filler" bs=1 count=$((avail - 600)) status=none 2>/dev/null ||
  dd if=/dev/zero of="$disk/filler" bs=4096 count=$(( (avail - 4096) / 4096 )) status=none
"$BIN" train --config "$WORK/good.toml" --train.out_dir "$disk/m" --train.checkpoint_interval -1 \
  >/dev/null 2>"$WORK/full_disk.err"
rc=$?
cat "$WORK/full_disk.err"
[ "$rc" -ne 0 ] || fail "training with a full metrics disk exited 0"
grep -Eq "^meshtrain: cannot write metrics file '.*metrics.jsonl'" "$WORK/full_disk.err" || fail "the error does not name the metrics file"
echo "full disk: PASS"
