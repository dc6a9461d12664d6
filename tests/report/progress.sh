#!/usr/bin/env bash
# The trainer's console: plain step lines when stdout is not a terminal; a
# progress bar redrawn in place (\r, steps, tokens/s, loss, ETA) under a pty.
# usage: progress.sh MESHTRAIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
out=$work/progress
rm -rf "$out"
mkdir -p "$out"
fail() { echo "FAIL: $*"; exit 1; }
args=(train --config "$work/good.toml" --train.steps 8 --train.checkpoint_interval 0
      --train.eval_interval 4 --train.log_interval 2 --train.threads 1)
"$bin" "${args[@]}" --train.out_dir "$out/plain" >"$out/plain.log" 2>&1 || { cat "$out/plain.log"; fail "plain run"; }
grep -q $'\r' "$out/plain.log" && fail "carriage returns in a non-terminal log"
[[ $(grep -cE '^step +[0-9]+/8 \| loss' "$out/plain.log") -eq 5 ]] || { cat "$out/plain.log"; fail "expected step lines 1, 2, 4, 6, 8"; }
python3 - "$bin" "$out/tty.log" "${args[@]}" --train.out_dir "$out/tty" <<'PY'
import os, pty, sys
binary, log, args = sys.argv[1], sys.argv[2], sys.argv[3:]
pid, fd = pty.fork()
if pid == 0:
    os.execv(binary, [binary] + args)
data = b""
while True:
    try:
        chunk = os.read(fd, 65536)
    except OSError:
        break
    if not chunk:
        break
    data += chunk
_, status = os.waitpid(pid, 0)
open(log, "wb").write(data)
assert os.waitstatus_to_exitcode(status) == 0, data.decode(errors="replace")[-2000:]
text = data.decode()
bars = [part for part in text.split("\r") if part.startswith("train [")]
assert len(bars) >= 2, text                      # redrawn in place (at most every 0.2 s, and at the end)
last = bars[-1]
assert "step 8/8" in last and "tok/s" in last and "loss " in last and "ETA 0:00" in last, last
assert "#" * 30 in last, last                    # full at the end
assert "val_loss" in text                        # validation still gets its own line
lines = [l for l in text.replace("\r\n", "\n").split("\n") if l.startswith("step ") and "| loss" in l]
assert not lines, lines                          # no plain step lines on a terminal
print("terminal: a bar redrawn in place:", last.split("\x1b")[0].strip())
PY
echo "progress: PASS"
