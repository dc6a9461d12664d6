#!/usr/bin/env bash
# DPO end to end (data.format = "preference-jsonl", [dpo]) on a base trained here and exported as
# a Hugging Face directory (tiny_base.sh), fp32:
#  1. LoRA, the reference being the model with its adapters off: the first step's loss is log 2
#     (the adapters start at B = 0, so policy = reference) and the loss falls; rewards and
#     accuracy in metrics.jsonl; a run resumed from its step-3 checkpoint writes a step-6
#     checkpoint identical byte for byte;
#  2. dp 2, ZeRO-3, tp 2, pp 2 and cp 2 give the one-rank losses and rewards (to 1e-5; pp
#     exactly);
#  3. the reference precomputed (dpo.precompute_reference = true, stored with the run) gives the
#     adapters-off run's losses; IPO and label smoothing run; QLoRA DPO starts at log 2; with
#     adapter dropout dp 2 equals one rank;
#     validation reports the DPO loss over the validation pairs (log 2 while policy = reference,
#     every reference mode; dp 2 and cp 2 = one rank);
#  4. full fine-tuning (its reference precomputed): log 2 first, resume byte for byte, and a
#     resumed run whose stored reference is gone stops with one line naming the file;
#  5. bad input: one line naming the record or key, exit 1 (a missing stored reference: 4, corrupt).
# usage: dpo.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR FIXTURES
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../support/cli_common.sh" "$@"
fixtures=${*: -1}
rm -rf "$work" && mkdir -p "$work"

common() {  # common OUT_DIR [DATA]: a LoRA DPO run's settings
  cat <<TOML
[train]
steps = 6
batch_size = 4
seq_len = 128
eval_interval = 0
checkpoint_interval = 3
peak_flops = 1e11
init_from = "$work/hf"
out_dir = "$1"
[optim]
lr = 1e-2
warmup_steps = 0
[data]
format = "preference-jsonl"
tokenizer = "bytes"
train = "${2:-$fixtures/pref_tiny.jsonl}"
[dpo]
beta = 0.5
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "v_proj", "down_proj"]
TOML
}
full() {  # full OUT_DIR: full fine-tuning, no [lora]
  common "$1" | sed '/^\[lora\]$/,$d; s/^lr = .*/lr = 1e-3/'
}
metric() {  # metric KEY FILE: the key's values over the steps
  python3 -c "import json,sys; print(' '.join(repr(json.loads(l)[sys.argv[1]]) for l in open(sys.argv[2]) if '\"loss\"' in l))" "$1" "$2"
}
close() {  # close NAME TOL A_FILE B_FILE: losses and rewards within TOL (relative)
  python3 - "$@" <<'PY'
import json, sys
name, tol, a, b = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
keys = ("loss", "rewards_chosen", "rewards_rejected", "rewards_accuracy")
rows = lambda f: [json.loads(l) for l in open(f) if '"loss"' in l]
ra, rb = rows(a), rows(b)
assert len(ra) == len(rb) == 6, (len(ra), len(rb))
worst = max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-3) for x, y in zip(ra, rb) for k in keys)
assert worst <= tol, (name, worst, [r["loss"] for r in ra], [r["loss"] for r in rb])
print(f"{name}: losses and rewards within {worst:.1e} of one rank")
PY
}
first_is_log2() {  # first_is_log2 NAME METRICS
  python3 -c "
import json, math, sys
l = [json.loads(x)['loss'] for x in open(sys.argv[2]) if '\"loss\"' in x]
assert abs(l[0] - math.log(2)) < 1e-6, l
print(f'{sys.argv[1]}: first loss log 2, then {l[-1]:.4f}')" "$1" "$2"
}

source "$here/tiny_base.sh"
tiny_base "$bin" "$work" "$fixtures"

# 1. LoRA, one rank; resume.
common "$work/one" >"$work/one.toml"
"$bin" train --config "$work/one.toml" >/dev/null
first_is_log2 lora "$work/one/metrics.jsonl"
python3 - "$work/one/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
last = rows[-1]
assert abs(last["rewards_margin"] - (last["rewards_chosen"] - last["rewards_rejected"])) < 1e-9
assert 0 <= last["rewards_accuracy"] <= 1 and rows[0]["rewards_chosen"] == 0
print(f"metrics: margin {last['rewards_margin']:.4f}, accuracy {last['rewards_accuracy']:.2f}")
PY
mkdir -p "$work/resumed" && cp -r "$work/one/step_3" "$work/resumed/"
common "$work/resumed" >"$work/resumed.toml"
"$bin" train --config "$work/resumed.toml" --resume "$work/resumed/step_3" >/dev/null
cmp "$work/one/step_6/rank_0.safetensors" "$work/resumed/step_6/rank_0.safetensors" ||
  fail "the resumed run's step-6 state differs"
echo "resume: step 6 identical byte for byte"

# 2. Layouts (2 ranks).
for layout in "dp 1 1 0 1 1e-5" "zero3 1 1 3 1 1e-5" "tp 2 1 0 1 1e-5" "pp 1 2 0 1 0" "cp 1 1 0 2 1e-5"; do
  read -r name tp pp zero cp tol <<<"$layout"
  { common "$work/$name"; printf '[parallel]\ntp = %s\npp = %s\nzero = %s\ncp = %s\n' "$tp" "$pp" "$zero" "$cp"; } >"$work/$name.toml"
  "${mpirun[@]}" 2 "$bin" train --config "$work/$name.toml" >/dev/null
  close "$name 2" "$tol" "$work/one/metrics.jsonl" "$work/$name/metrics.jsonl"
done

# 3. The reference precomputed; IPO; label smoothing; QLoRA.
common "$work/pre" | sed 's/^beta = .*/&\nprecompute_reference = true/' >"$work/pre.toml"
"$bin" train --config "$work/pre.toml" >/dev/null
[ -f "$work/pre/reference_logps.safetensors" ] || fail "no stored reference"
close "precomputed reference" 1e-5 "$work/one/metrics.jsonl" "$work/pre/metrics.jsonl"
{ common "$work/pre_cp" | sed 's/^beta = .*/&\nprecompute_reference = true/'; printf '[parallel]\ncp = 2\n'; } >"$work/pre_cp.toml"
"${mpirun[@]}" 2 "$bin" train --config "$work/pre_cp.toml" >/dev/null
close "precomputed reference, cp 2" 1e-5 "$work/one/metrics.jsonl" "$work/pre_cp/metrics.jsonl"
common "$work/ipo" | sed 's/^beta = .*/beta = 0.5\nloss = "ipo"/' >"$work/ipo.toml"
"$bin" train --config "$work/ipo.toml" >/dev/null
python3 -c "
import json, sys
l = [json.loads(x)['loss'] for x in open(sys.argv[1]) if '\"loss\"' in x]
assert abs(l[0] - 1.0) < 1e-6 and l[-1] < l[0], l  # (0 - 1/(2 beta))^2 = 1 at the start
print(f'ipo: first loss 1 = (1/(2 beta))^2, then {l[-1]:.4f}')" "$work/ipo/metrics.jsonl"
common "$work/smooth" | sed 's/^beta = .*/&\nlabel_smoothing = 0.1/' >"$work/smooth.toml"
"$bin" train --config "$work/smooth.toml" >/dev/null
first_is_log2 "label smoothing 0.1" "$work/smooth/metrics.jsonl"
common "$work/qlora" | sed 's/^targets = .*/&\nquantize_base = "nf4"/' >"$work/qlora.toml"
"$bin" train --config "$work/qlora.toml" >/dev/null
first_is_log2 qlora "$work/qlora/metrics.jsonl"
# Adapter dropout: the policy's log-probabilities are the training pass's own (masks keyed by
# sample and position), so dp 2 still equals one rank (5e-5: rewards near zero, relative to
# max(|r|, 1e-3), measured 1.9e-5 on an Intel Xeon VM with AMX).
common "$work/dropout" | sed 's/^targets = .*/&\ndropout = 0.1/' >"$work/dropout.toml"
"$bin" train --config "$work/dropout.toml" >/dev/null
{ common "$work/dropout_dp" | sed 's/^targets = .*/&\ndropout = 0.1/'; } >"$work/dropout_dp.toml"
"${mpirun[@]}" 2 "$bin" train --config "$work/dropout_dp.toml" >/dev/null
close "lora.dropout 0.1, dp 2" 5e-5 "$work/dropout/metrics.jsonl" "$work/dropout_dp/metrics.jsonl"

# Validation (data.val of preference pairs) reports the mean DPO loss over its pairs: log 2 while
# the policy is the reference (lr 0), for each reference mode and full fine-tuning; trained, it
# falls, and dp 2 gives the one-rank values.
with_val() {  # with_val LR: the settings on stdin with validation every 3 steps at learning rate LR
  sed "s/^eval_interval = 0$/eval_interval = 3\nval = \"$(printf '%s' "$fixtures" | sed 's#/#\\/#g')\/pref_tiny.jsonl\"/; s/^lr = .*/lr = $1\nmin_lr = 0/" |
    awk '/^val = /{v=$0; next} {print} /^\[data\]$/{print v}'
}
val_losses() { python3 -c "import json,sys; print(' '.join(repr(json.loads(l)['val_loss']) for l in open(sys.argv[1]) if 'val_loss' in l))" "$1"; }
for run in "val_off common" "val_pre pre" "val_full full"; do
  read -r name kind <<<"$run"
  case $kind in
    common) common "$work/$name" | with_val 1e-30 ;;
    pre) common "$work/$name" | sed 's/^beta = .*/&\nprecompute_reference = true/' | with_val 1e-30 ;;
    full) full "$work/$name" | with_val 1e-30 ;;
  esac >"$work/$name.toml"
  "$bin" train --config "$work/$name.toml" >/dev/null
  python3 -c "
import math, sys
v = [float(x) for x in sys.argv[2:]]
assert len(v) == 2 and all(abs(x - math.log(2)) < 1e-6 for x in v), v
print(f'{sys.argv[1]}: val_loss log 2 while the policy is the reference')" "$name" $(val_losses "$work/$name/metrics.jsonl")
done
python3 - "$work/val_full/reference_logps.safetensors" <<'PY'
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    names = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
assert {"logps", "offsets", "val_logps", "val_offsets"} <= names.keys(), names.keys()
print("stored reference: the training and the validation tables")
PY
# Trained on the 4 pairs it validates on (every step trains on all of them), the validation loss
# after step 3 is step 4's training loss: the same pairs at the same weights, against the same
# reference (adapters off, and precomputed for full fine-tuning).
head -4 "$fixtures/pref_tiny.jsonl" >"$work/pref4.jsonl"
for run in "step4_lora common" "step4_full full"; do
  read -r name kind <<<"$run"
  case $kind in
    common) common "$work/$name" "$work/pref4.jsonl" ;;
    full) full "$work/$name" | sed "s#^train = .*#train = \"$work/pref4.jsonl\"#" ;;
  esac | with_val 1e-2 | sed "s#^val = .*#val = \"$work/pref4.jsonl\"#; s/^eval_interval = 3$/&\neval_batches = 1/" >"$work/$name.toml"
  "$bin" train --config "$work/$name.toml" >/dev/null
  python3 - "$name" "$work/$name/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[2])]
val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
train = {r["step"]: r["loss"] for r in rows if "loss" in r}
assert abs(val[3] - train[4]) <= 1e-6 * train[4], (val, train)
print(f"{sys.argv[1]}: val_loss after step 3 {val[3]:.6f} = step 4's loss {train[4]:.6f}")
PY
done
common "$work/val_one" | with_val 1e-2 >"$work/val_one.toml"
"$bin" train --config "$work/val_one.toml" >/dev/null
common "$work/val_dp" | with_val 1e-2 >"$work/val_dp.toml"
"${mpirun[@]}" 2 "$bin" train --config "$work/val_dp.toml" >/dev/null
{ common "$work/val_cp" | with_val 1e-2; printf '[parallel]\ncp = 2\n'; } >"$work/val_cp.toml"
"${mpirun[@]}" 2 "$bin" train --config "$work/val_cp.toml" >/dev/null
python3 -c "
import math, sys
n = len(sys.argv) // 2
a, b = [float(x) for x in sys.argv[1:n + 1]], [float(x) for x in sys.argv[n + 1:]]
assert len(a) == len(b) == 2 and a[-1] < math.log(2), (a, b)
worst = max(abs(x - y) / x for x, y in zip(a, b))
assert worst < 1e-5, (a, b)
print(f'val_loss {a[0]:.4f} -> {a[1]:.4f}; dp 2 within {worst:.1e}')" $(val_losses "$work/val_one/metrics.jsonl") $(val_losses "$work/val_dp/metrics.jsonl")
python3 -c "
import sys
n = len(sys.argv) // 2
a, b = [float(x) for x in sys.argv[1:n + 1]], [float(x) for x in sys.argv[n + 1:]]
worst = max(abs(x - y) / x for x, y in zip(a, b))
assert len(a) == len(b) == 2 and worst < 1e-5, (a, b)
print(f'val_loss at cp 2 within {worst:.1e} of one rank')" $(val_losses "$work/val_one/metrics.jsonl") $(val_losses "$work/val_cp/metrics.jsonl")
python3 - "$work"/{cp,pre_cp,val_cp}/metrics.jsonl <<'PY'
import json, sys
for path in sys.argv[1:]:  # rank 0's peaks at the end against the memory plan's prediction
    end = [r for r in map(json.loads, open(path)) if r.get("memory") == "end"][-1]
    cats = ("params", "grads", "optimizer", "activations", "workspace")
    off = {c: (end["bytes"][c + "_peak"], end["predicted"][c]) for c in cats
           if end["bytes"][c + "_peak"] != end["predicted"][c]}
    assert not off, (path, off)
print("cp 2: every memory category as predicted")
PY

# 4. Full fine-tuning.
full "$work/full" >"$work/full.toml"
"$bin" train --config "$work/full.toml" >/dev/null
first_is_log2 "full fine-tuning" "$work/full/metrics.jsonl"
mkdir -p "$work/full_resumed" && cp -r "$work/full/step_3" "$work/full/reference_logps.safetensors" "$work/full_resumed/"
full "$work/full_resumed" >"$work/full_resumed.toml"
"$bin" train --config "$work/full_resumed.toml" --resume "$work/full_resumed/step_3" >/dev/null
cmp "$work/full/step_6/rank_0.safetensors" "$work/full_resumed/step_6/rank_0.safetensors" ||
  fail "the resumed full fine-tuning run's step-6 state differs"
echo "full fine-tuning resume (stored reference): step 6 identical byte for byte"

# 5. Bad input.
rm -rf "$work/gone" && mkdir -p "$work/gone" && cp -r "$work/full/step_3" "$work/gone/"
full "$work/gone" >"$work/gone.toml"
EXIT=4 expect_error "reference_logps.safetensors' is missing" "$work/gone.toml" --resume "$work/gone/step_3"
printf '%s\n' '{"prompt": "Hi", "chosen": "Hello."}' >"$work/no_rejected.jsonl"
common "$work/bad" "$work/no_rejected.jsonl" >"$work/no_rejected.toml"
expect_error "no_rejected.jsonl:1: field 'rejected' missing" "$work/no_rejected.toml"
python3 -c "print('{\"prompt\": \"' + 'x' * 150 + '\", \"chosen\": \"Yes.\", \"rejected\": \"No.\"}')" >"$work/long_prompt.jsonl"
common "$work/bad" "$work/long_prompt.jsonl" >"$work/long_prompt.toml"
expect_error "long_prompt.jsonl:1: the chosen response is empty after truncation" "$work/long_prompt.toml"
common "$work/bad" | sed '/^\[lora\]$/,$d; s/^beta = .*/precompute_reference = false/' >"$work/no_lora.toml"
expect_error "dpo.precompute_reference = false needs LoRA" "$work/no_lora.toml"
common "$work/bad" | sed 's/^format = .*/format = "sft-jsonl"/; s#^train = .*#train = "'"$fixtures"'/sft_tiny.jsonl"#' >"$work/beta_sft.toml"
expect_error 'dpo.beta applies to data.format = "preference-jsonl" only' "$work/beta_sft.toml"
echo "dpo: all checks passed"
