#!/usr/bin/env bash
# QLoRA end to end (lora.quantize_base = "nf4"): a base trained here and exported as a Hugging
# Face directory, then SFT with [lora] on its NF4-quantised base.
#  1. the loss falls; the checkpoint holds no NF4 base tensor (it is rebuilt from init_from);
#  2. a run resumed from its step-3 checkpoint writes a step-6 checkpoint identical byte for byte
#     to the uninterrupted run's;
#  3. pp 2 and full recompute give the one-rank losses (to 1e-12), dp 2 and ZeRO 1/2/3 to 1e-5
#     (bf16 GEMMs over half the rows), tp 2 to 1e-4 on a wider base (each rank holds its blocks
#     of the tensor quantised whole: the one-rank values; its bf16 row-parallel partial sums
#     round differently: 2.6e-5 by step 5 on an Intel Xeon VM with AMX, under 1e-5 on Zen 4);
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
close() {  # close NAME TOL A... -- B...: the two loss lists within TOL (relative)
  python3 -c "
import sys
n = int(sys.argv[2]); tol = float(sys.argv[3]); a = [float(x) for x in sys.argv[4:4 + n]]; b = [float(x) for x in sys.argv[4 + n:]]
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
assert len(a) == len(b) == 6 and worst <= tol, (a, b)
print(f'{sys.argv[1]}: losses within {worst:.1e} of one rank')" "$@"
}
for layout in "dp 1 1 0 1e-5" "zero1 1 1 1 1e-5" "zero2 1 1 2 1e-5" "zero3 1 1 3 1e-5" \
              "pp 1 2 0 1e-12"; do
  read -r name tp pp zero tol <<<"$layout"
  { common "$work/$name"; printf '[parallel]\ntp = %s\npp = %s\nzero = %s\n' "$tp" "$pp" "$zero"; } >"$work/$name.toml"
  "${mpirun[@]}" 2 "$bin" train --config "$work/$name.toml" >/dev/null
  read -ra got <<<"$(losses "$work/$name/metrics.jsonl")"
  close "$name 2" "${#one[@]}" "$tol" "${one[@]}" "${got[@]}"
done
# tp 2 on a base whose row-parallel layers' rank slices are whole blocks of every row (in
# features / 2 a multiple of 64): each rank holds its blocks of the tensor quantised whole,
# so the values are the one-rank ones bit for bit.
tiny_base "$bin" "$work" "$fixtures" wide "dim = 128
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 256
vocab_size = 256
max_seq_len = 128
tie_embeddings = false"
common "$work/wide_one" | sed "s#^init_from = .*#init_from = \"$work/hf_wide\"#" >"$work/wide_one.toml"
"$bin" train --config "$work/wide_one.toml" >/dev/null
{ common "$work/wide_tp" | sed "s#^init_from = .*#init_from = \"$work/hf_wide\"#"; printf '[parallel]\ntp = 2\n'; } >"$work/wide_tp.toml"
"${mpirun[@]}" 2 "$bin" train --config "$work/wide_tp.toml" >/dev/null
read -ra wide_one <<<"$(losses "$work/wide_one/metrics.jsonl")"
read -ra wide_tp <<<"$(losses "$work/wide_tp/metrics.jsonl")"
close "tp 2" "${#wide_one[@]}" 1e-4 "${wide_one[@]}" "${wide_tp[@]}"

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
expect_error "this rank's slice of 'model.layers.0.self_attn.k_proj.weight' \\(800 of 800 elements\\) cuts NF4 blocks of 64" "$work/blocks.toml"
# tp 2 on llama-tiny: o_proj's rows (64 inputs) would be cut into halves of 32.
{ common "$work/bad"; printf '[parallel]\ntp = 2\n'; } >"$work/tp_cut.toml"
rc=0
"${mpirun[@]}" 2 "$bin" train --config "$work/tp_cut.toml" >"$work/out" 2>"$work/err" || rc=$?
[ "$rc" -ne 0 ] && grep -q "this rank's slice of 'model.layers.0.self_attn.o_proj.weight' (2048 of 4096 elements) cuts NF4 blocks" "$work/err" ||
  fail "tp 2 cutting NF4 blocks: exit $rc, $(head -3 "$work/err")"
echo "ok: tp 2 refused where its cut falls inside NF4 blocks"
# A changed train.init_from: the NF4 base is rebuilt from it, so a resume and an export check
# the digest the checkpoint recorded and stop with one line naming the key.
cp -r "$work/hf" "$work/hf_changed"
common "$work/changed" | sed "s#^init_from = .*#init_from = \"$work/hf_changed\"#; s/^steps = 6$/steps = 3/" >"$work/changed.toml"
"$bin" train --config "$work/changed.toml" >/dev/null
python3 - "$work/hf_changed/model.safetensors" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:  # one byte of the last tensor's data
    f.seek(-3, 2)
    b = f.read(1)
    f.seek(-3, 2)
    f.write(bytes([b[0] ^ 0x10]))
PY
sed 's/^steps = 3$/steps = 6/' "$work/changed.toml" >"$work/changed_resume.toml"
expect_error "train.init_from '$work/hf_changed' has changed since the run began .*checkpoint '$work/changed/step_3' recorded" \
  "$work/changed_resume.toml" --resume "$work/changed/step_3"
rc=0
"$bin" ckpt export --format hf --merge-lora --checkpoint "$work/changed/step_3" --out "$work/changed_export" >"$work/out" 2>"$work/err" || rc=$?
[ "$rc" -eq 1 ] && [ "$(wc -l <"$work/err")" -eq 1 ] && grep -q "train.init_from '$work/hf_changed' has changed" "$work/err" ||
  fail "export from a changed init_from: exit $rc, $(cat "$work/err")"
echo "ok: $(cat "$work/err")"
echo "qlora: ok"
