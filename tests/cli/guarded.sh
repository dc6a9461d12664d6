#!/usr/bin/env bash
# The engine's device discipline, checked on the CPU: train.device = "guarded"
# (backend/guarded: the CPU kernels, every tensor in memory the host cannot
# touch outside the backend's ops, every op refusing host pointers) must give
# the CPU backend's losses bit for bit in every layout, multi-rank runs moving
# tensors through the routed world's staged side (comm/routed.h) and host data
# through MPI. A host access to a tensor aborts the run naming it; an op given
# host memory is an Error naming the op: either fails this test.
# usage: guarded.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../support/cli_common.sh" "$@"
bash "$here/make_inputs.sh" "$work" >/dev/null

cat >"$work/base.toml" <<TOML
[model]
preset = "llama-tiny"
[train]
steps = 3
batch_size = 8
micro_batch_size = 4
seq_len = 64
eval_interval = 3
eval_batches = 1
log_interval = 1
peak_flops = 1e11
checkpoint_interval = -1
[optim]
lr = 3e-3
warmup_steps = 1
[data]
train = "$work/train.bin"
val = "$work/val.bin"
tokenizer = "bytes"
TOML

losses() {  # the run's losses and validation losses, one per line, as logged (all digits)
  python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    for key in ("loss", "val_loss"):
        if key in r and "memory" not in r: print(r["step"], key, repr(r[key]))' "$1/metrics.jsonl"
}

# same RANKS NAME ARGS...: the run on the CPU and on the guarded backend, losses equal.
same() {
  local ranks=$1 name=$2
  shift 2
  for device in cpu guarded; do
    local out=$work/$name-$device
    local run=("$bin" train --config "$work/base.toml" --train.device "$device"
               --train.out_dir "$out" "$@")
    if ((ranks > 1)); then run=("${mpirun[@]}" "$ranks" "${run[@]}"); fi
    "${run[@]}" >"$out.log" 2>&1 || fail "$name on $device: $(grep -m1 -E 'guarded|meshtrain:' "$out.log" || tail -3 "$out.log")"
  done
  [[ $(losses "$work/$name-cpu") == "$(losses "$work/$name-guarded")" ]] ||
    fail "$name: the guarded run's losses differ: $(diff <(losses "$work/$name-cpu") <(losses "$work/$name-guarded") | head -4)"
  echo "ok: $name ($ranks ranks): $(losses "$work/$name-cpu" | wc -l) losses equal"
}

moe=(--moe.experts 4 --moe.top_k 2 --moe.hidden_dim 48 --moe.aux_loss 0.01)
same 1 one_rank
same 1 bf16_recompute --train.precision bf16 --train.recompute full
same 1 moe "${moe[@]}" --moe.capacity_factor 1.0
same 1 qlora --lora.rank 4 --lora.alpha 8 --lora.quantize_base nf4
same 2 ddp
same 2 zero3_offload --parallel.zero 3 --parallel.offload cpu
same 2 zero2_bf16 --parallel.zero 2 --train.precision bf16
same 2 tp_sp --parallel.tp 2 --parallel.sequence_parallel true
same 2 pp --parallel.pp 2
same 2 cp_ring --parallel.cp 2 --parallel.cp_comm ring
same 2 ep "${moe[@]}" --parallel.ep 2 --parallel.zero 1

# A ZeRO-3 checkpoint written by two guarded ranks resumes on one.
"${mpirun[@]}" 2 "$bin" train --config "$work/base.toml" --train.device guarded \
  --train.out_dir "$work/resume" --parallel.zero 3 --train.steps 2 --train.checkpoint_interval 2 \
  >"$work/resume.log" 2>&1 || fail "the ZeRO-3 run to resume: $(tail -3 "$work/resume.log")"
"$bin" train --config "$work/base.toml" --train.device guarded --train.out_dir "$work/resume" \
  --resume auto >>"$work/resume.log" 2>&1 || fail "the resumed run: $(tail -3 "$work/resume.log")"
# (dp 2 against 1 rank: within 1e-5 relative, the layouts' tolerance, docs/distributed.md)
python3 - "$work/resume" "$work/one_rank-cpu" <<'PY' || fail "the resumed step 3 is not the uninterrupted run's"
import json, sys
def step3(run):
    return [r["loss"] for r in map(json.loads, open(run + "/metrics.jsonl"))
            if r.get("step") == 3 and "loss" in r and "memory" not in r][0]
a, b = step3(sys.argv[1]), step3(sys.argv[2])
sys.exit(0 if abs(a - b) <= 1e-5 * abs(b) else 1)
PY
echo "ok: a guarded ZeRO-3 checkpoint of 2 ranks resumed on 1 continues the trace"
