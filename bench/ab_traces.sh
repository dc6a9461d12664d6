#!/usr/bin/env bash
# Two meshtrain binaries (before / after a change that must not change
# behaviour) train the same runs: every rank's losses, gradient norms and
# validation losses must be identical and the final checkpoints' tensors the
# same bytes. Runs: one rank fp32, bf16 and fp16; dp 2 ZeRO-3 with disk offload;
# tp 2 + sequence parallel (llama, and GPT-2 for learned positions and
# biases); pp 2 interleaved (2 virtual stages); LoRA + SFT, without and with
# adapter dropout. llama-tiny (4 layers) on random byte tokens, 12 steps.
# usage: bench/ab_traces.sh BIN_A BIN_B
set -euo pipefail
A=$1 B=$2
MESHTRAIN_BIN=$A source "$(dirname "$0")/common.sh"
fixtures=tests/train/fixtures
python3 tests/support/random_tokens.py "$work/train.bin" 200000 256 1
python3 tests/support/random_tokens.py "$work/val.bin" 20000 256 2
cat >"$work/run.toml" <<TOML
[model]
preset = "llama-tiny"
n_layers = 4
[train]
steps = 12
batch_size = 8
micro_batch_size = 2
seq_len = 64
threads = 1
eval_interval = 6
eval_batches = 2
checkpoint_interval = 12
peak_flops = 1e11
[optim]
lr = 3e-3
warmup_steps = 2
[data]
tokenizer = "bytes"
train = "$work/train.bin"
val = "$work/val.bin"
TOML
sed -e 's/^preset = "llama-tiny"$/family = "gpt2"\ndim = 64\nn_heads = 4\nhidden_dim = 256\nvocab_size = 256\nmax_seq_len = 128/' \
  "$work/run.toml" >"$work/gpt2.toml"
cat >"$work/sft.toml" <<TOML
[model]
preset = "llama-tiny"
[train]
steps = 12
batch_size = 4
seq_len = 128
threads = 1
eval_interval = 6
eval_batches = 1
checkpoint_interval = 12
peak_flops = 1e11
[optim]
lr = 3e-2
warmup_steps = 0
[data]
format = "sft-jsonl"
tokenizer = "bytes"
sft_pack = true
train = "$fixtures/sft_tiny.jsonl"
val = "$fixtures/sft_tiny_val.jsonl"
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "v_proj", "down_proj"]
TOML
# name ranks config overrides...
runs=(
  "fp32 1 run.toml"
  "bf16 1 run.toml --train.precision bf16"
  "fp16 1 run.toml --train.precision fp16"
  "dp2_zero3_disk 2 run.toml --parallel.zero 3 --parallel.offload disk --parallel.offload_dir OUT/offload"
  "tp2_sp 2 run.toml --parallel.tp 2 --parallel.sequence_parallel true"
  "gpt2_tp2_sp 2 gpt2.toml --parallel.tp 2 --parallel.sequence_parallel true"
  "pp2_interleaved 2 run.toml --parallel.pp 2 --parallel.schedule interleaved --parallel.virtual_stages 2"
  "lora_sft 1 sft.toml"
  "lora_dropout 1 sft.toml --lora.dropout 0.1"
)
failed=0
for spec in "${runs[@]}"; do
  read -r name ranks config overrides <<<"$spec"
  for side in A B; do
    bin=$A; [ "$side" = B ] && bin=$B
    out="$work/$name.$side"
    args=(train --config "$work/$config" --train.out_dir "$out" ${overrides//OUT/$out})
    if [ "$ranks" = 1 ]; then
      "$bin" "${args[@]}" >"$out.log" 2>&1 || { tail "$out.log"; exit 1; }
    else
      "${MPIRUN[@]}" -np "$ranks" "$bin" "${args[@]}" >"$out.log" 2>&1 || { tail "$out.log"; exit 1; }
    fi
  done
  python3 - "$work/$name.A" "$work/$name.B" "$name" <<'PY' || failed=1
import glob, json, os, sys
a, b, name = sys.argv[1:4]
def trace(run):
    out = {}
    for path in sorted(glob.glob(f"{run}/metrics*.jsonl")):
        for line in open(path):
            r = json.loads(line)
            for key in ("loss", "grad_norm", "val_loss"):
                if key in r:
                    out[(os.path.basename(path), r["step"], key)] = r[key]
    return out
ta, tb = trace(a), trace(b)
same = ta == tb and len(ta) > 0
print(f"{name:18s} {len(ta):4d} values: {'bit-identical' if same else 'DIFFERENT'}")
if not same:
    diff = [k for k in ta if ta.get(k) != tb.get(k)][:3]
    print("  first differences:", [(k, ta.get(k), tb.get(k)) for k in diff])
    sys.exit(1)
PY
  python3 tests/launch/same_checkpoint.py "$work/$name.A/step_12" "$work/$name.B/step_12" | sed 's/^/  checkpoint: /' || failed=1
done
exit $failed
