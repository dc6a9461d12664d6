#!/usr/bin/env bash
# QLoRA end to end (lora.quantize_base = "nf4"): a base trained here and exported as a Hugging
# Face directory, then SFT with [lora] on its NF4-quantised base.
#  1. the loss falls; the checkpoint holds no NF4 base tensor (it is rebuilt from init_from);
#  2. a run resumed from its step-3 checkpoint writes a step-6 checkpoint identical byte for byte
#     to the uninterrupted run's;
#  3. pp 2 and full recompute give the one-rank losses (to 1e-12), dp 2 and ZeRO 1/2/3 to 1e-5
#     (bf16 GEMMs over half the rows);
#     tp 2 within 1e-2 (each rank quantises
#     its own slice: the same blocks and codes, but its own second-level scales);
#  4. exports: --merge-lora equals --base-only plus the PEFT adapter's delta (B A · alpha/r),
#     and samples the same greedy tokens as the checkpoint; plain LoRA from the base-only export
#     repeats the QLoRA run loss for loss (the trained base is the exported one); with
#     bitsandbytes (HF_PYTHON),
#     the base-only export is bitsandbytes' own quantisation of the HF base, dequantised;
#  5. bad input: one line naming the key, exit 1.
# usage: qlora.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR FIXTURES HF_PYTHON
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../support/cli_common.sh" "$@"
rest=("${@:$#-1}")
fixtures=${rest[0]} hf_py=${rest[1]}
rm -rf "$work" && mkdir -p "$work"

common() {  # common OUT_DIR: the run's settings
  cat <<TOML
[train]
steps = 6
batch_size = 4
seq_len = 128
eval_interval = 0
checkpoint_interval = 3
peak_flops = 1e11
precision = "bf16"
init_from = "$work/hf"
out_dir = "$1"
[optim]
lr = 3e-2
warmup_steps = 0
[data]
format = "sft-jsonl"
tokenizer = "bytes"
sft_pack = true
train = "$fixtures/sft_tiny.jsonl"
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "v_proj", "down_proj"]
quantize_base = "nf4"
TOML
}
losses() { python3 -c "import json,sys; print(' '.join(repr(json.loads(l)['loss']) for l in open(sys.argv[1]) if '\"loss\"' in l))" "$1"; }

source "$here/tiny_base.sh"
tiny_base "$bin" "$work" "$fixtures"

# 1. One rank.
common "$work/one" >"$work/one.toml"
"$bin" train --config "$work/one.toml" >/dev/null
read -ra one <<<"$(losses "$work/one/metrics.jsonl")"
python3 -c "import sys; l = [float(x) for x in sys.argv[1:]]; assert len(l) == 6 and l[-1] < l[0], l; print(f'qlora: loss {l[0]:.4f} -> {l[-1]:.4f}')" "${one[@]}"
python3 - "$work/one/step_6/manifest.json" <<'PY'
import json, sys
names = json.dumps(json.load(open(sys.argv[1])))
assert "q_proj.weight" not in names and "down_proj.weight" not in names, "an NF4 base tensor was saved"
assert "q_proj.lora_A.weight" in names and "embed_tokens.weight" in names
print("checkpoint: adapters and the unquantised tensors, no NF4 base")
PY

# 2. Resume from step 3: the same step-6 checkpoint, byte for byte.
mkdir -p "$work/resumed" && cp -r "$work/one/step_3" "$work/resumed/"
common "$work/resumed" >"$work/resumed.toml"
"$bin" train --config "$work/resumed.toml" --resume "$work/resumed/step_3" >/dev/null
cmp "$work/one/step_6/rank_0.safetensors" "$work/resumed/step_6/rank_0.safetensors" ||
  fail "the resumed run's step-6 state differs"
echo "resume: step 6 identical byte for byte"

# 3. Layouts.
for layout in "dp 1 1 0 1e-5" "zero1 1 1 1 1e-5" "zero2 1 1 2 1e-5" "zero3 1 1 3 1e-5" \
              "pp 1 2 0 1e-12" "tp 2 1 0 1e-2"; do
  read -r name tp pp zero tol <<<"$layout"
  { common "$work/$name"; printf '[parallel]\ntp = %s\npp = %s\nzero = %s\n' "$tp" "$pp" "$zero"; } >"$work/$name.toml"
  "${mpirun[@]}" 2 "$bin" train --config "$work/$name.toml" >/dev/null
  read -ra got <<<"$(losses "$work/$name/metrics.jsonl")"
  python3 -c "
import sys
n = int(sys.argv[1]); tol = float(sys.argv[2]); a = [float(x) for x in sys.argv[3:3 + n]]; b = [float(x) for x in sys.argv[3 + n:]]
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
assert len(a) == len(b) == 6 and worst <= tol, (a, b)
print(f'$name 2: losses within {worst:.1e} of one rank')" "${#one[@]}" "$tol" "${one[@]}" "${got[@]}"
done

# init_from the base's training checkpoint (read tensor by tensor from its shards) instead of its
# HF export: the same NF4 base, the same losses.
common "$work/from_ckpt" | sed "s#^init_from = .*#init_from = \"$work/base/step_2\"#" >"$work/from_ckpt.toml"
"$bin" train --config "$work/from_ckpt.toml" >/dev/null
[ "$(losses "$work/from_ckpt/metrics.jsonl")" = "$(losses "$work/one/metrics.jsonl")" ] ||
  fail "init_from the training checkpoint gives other losses than from its HF export"
echo "init_from a training checkpoint: the same losses as from its HF export"

# Full recompute (the dequantisation runs again in the recomputed forward): the same losses.
{ common "$work/recompute" | sed 's/^\[train\]$/[train]\nrecompute = "full"/'; } >"$work/recompute.toml"
"$bin" train --config "$work/recompute.toml" >/dev/null
[ "$(losses "$work/recompute/metrics.jsonl")" = "$(losses "$work/one/metrics.jsonl")" ] ||
  fail "recompute full changes the QLoRA losses"
echo "recompute full: the same losses"

# 4. Exports.
"$bin" ckpt export --format hf --merge-lora --checkpoint "$work/one/step_6" --out "$work/merged" >/dev/null
"$bin" ckpt export --format hf --base-only --checkpoint "$work/one/step_6" --out "$work/base_only" >/dev/null
"$bin" ckpt export --format peft --checkpoint "$work/one/step_6" --out "$work/peft" >/dev/null
/usr/bin/python3 "$here/qlora_exports.py" "$work/merged" "$work/base_only" "$work/peft"
a=$("$bin" sample --checkpoint "$work/one/step_6" --prompt "User: hi" --temperature 0 --max-new-tokens 16 --print-ids | head -1)
b=$("$bin" sample --checkpoint "$work/merged" --prompt "User: hi" --temperature 0 --max-new-tokens 16 --print-ids | head -1)
[ "$a" = "$b" ] || fail "the merged export samples $b, the checkpoint $a"
echo "merged export: the checkpoint's greedy tokens"
# The base the run trained on is the one the exports rebuild: plain LoRA from the base-only
# export (its bf16 copies are the same roundings of the same dequantised values) repeats the run.
common "$work/on_export" | sed "s#^init_from = .*#init_from = \"$work/base_only\"#; /^quantize_base/d" >"$work/on_export.toml"
"$bin" train --config "$work/on_export.toml" >/dev/null
[ "$(losses "$work/on_export/metrics.jsonl")" = "$(losses "$work/one/metrics.jsonl")" ] ||
  fail "LoRA on the dequantised base export does not repeat the QLoRA run"
echo "plain LoRA on the base-only export: the QLoRA run's losses exactly"
if [ -x "$hf_py" ] && "$hf_py" -c "import bitsandbytes, peft" 2>/dev/null; then
  "$hf_py" "$here/qlora_exports.py" --bitsandbytes "$work/hf" "$work/base_only" "$work/peft"
else
  echo "bitsandbytes check: SKIPPED (no bitsandbytes in $hf_py)"
fi

# 5. Bad input.
common "$work/bad" | sed 's/^rank = 4$/rank = 0/; /^alpha/d; /^targets/d' >"$work/no_rank.toml"
expect_error 'lora.quantize_base = "nf4" .*needs lora.rank >= 1' "$work/no_rank.toml"
common "$work/bad" | sed 's/^quantize_base = "nf4"$/quantize_base = "int3"/' >"$work/unknown.toml"
expect_error 'lora.quantize_base: unknown quantisation "int3"' "$work/unknown.toml"
{ common "$work/bad" | sed '/^init_from/d'; printf '[model]\npreset = "llama-tiny"\ndim = 40\nn_heads = 4\nn_kv_heads = 2\n'; } >"$work/blocks.toml"
expect_error "'model.layers.0.self_attn.k_proj.weight' holds 800 elements on this rank, not a multiple of the NF4 block" "$work/blocks.toml"
echo "qlora: ok"
