#!/usr/bin/env bash
# --resume auto on one rank, two meshtrain binaries (before / after a change):
# a llama-60M checkpoint with AdamW state (~0.64 GB) written once by BIN_A,
# then resumed alternately by A and B (page cache warm: the file was just
# written or read). Prints per resume the trainer's setup time up to the
# resume event (setup_ms: choosing the checkpoint, data, model, load), the
# load alone (load_ms) and, where the binary reports it, the bytes the load read.
# Then the size of a LoRA checkpoint of the same model (rank 8 on q/k/v/o)
# written by each binary.
# usage: bench/resume_time.sh BIN_A BIN_B [ROUNDS=3]
set -euo pipefail
A=$1 B=$2 ROUNDS=${3:-3}
MESHTRAIN_BIN=$A source "$(dirname "$0")/common.sh"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
random_tokens 100000
write_run_config <<TOML
steps = 1
batch_size = 1
micro_batch_size = 1
TOML
"$A" train --config "$work/run.toml" --train.out_dir "$work/run" --train.checkpoint_interval 1 \
  >/dev/null
echo "{\"checkpoint_bytes\": $(du -sb "$work/run/step_1" | cut -f1)}"
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    bin=$A; [ "$side" = B ] && bin=$B
    "$bin" train --config "$work/run.toml" --train.out_dir "$work/run" --resume auto >/dev/null
    python3 - "$work/run/metrics.jsonl" "$side" "$round" <<'PY'
import json, sys
event = [r for r in map(json.loads, open(sys.argv[1])) if r.get("event") == "resume"][-1]
print(json.dumps({"binary": sys.argv[2], "round": int(sys.argv[3]),
                  "setup_ms": round(event["setup_ms"]), "load_ms": round(event["load_ms"]),
                  "load_bytes": event.get("load_bytes")}))
PY
  done
done
for side in A B; do
  bin=$A; [ "$side" = B ] && bin=$B
  { cat "$work/run.toml"; printf '[lora]\nrank = 8\nalpha = 16\ntargets = ["q_proj", "k_proj", "v_proj", "o_proj"]\n'; } \
    >"$work/lora.toml"
  "$bin" train --config "$work/lora.toml" --train.out_dir "$work/lora.$side" \
    --train.checkpoint_interval 1 >/dev/null
  echo "{\"binary\": \"$side\", \"lora_checkpoint_bytes\": $(du -sb "$work/lora.$side/step_1" | cut -f1)}"
done
