# Sourced by the fine-tuning CLI tests: tiny_base MESHTRAIN WORK_DIR FIXTURES [NAME MODEL_TOML]
# trains llama-tiny (or the [model] lines MODEL_TOML) for 2 steps on the SFT fixture
# (WORK_DIR/base[_NAME]) and exports it as a Hugging Face directory, WORK_DIR/hf[_NAME]: the base
# model the fine-tunes start from.
tiny_base() {
  local bin=$1 work=$2 fixtures=$3 suffix=${4:+_$4} model=${5:-'preset = "llama-tiny"'}
  cat >"$work/base$suffix.toml" <<TOML
[model]
$model
[train]
steps = 2
batch_size = 4
seq_len = 128
eval_interval = 0
peak_flops = 1e11
out_dir = "$work/base$suffix"
[data]
format = "sft-jsonl"
tokenizer = "bytes"
train = "$fixtures/sft_tiny.jsonl"
TOML
  "$bin" train --config "$work/base$suffix.toml" >/dev/null
  "$bin" ckpt export --format hf --checkpoint "$work/base$suffix/step_2" --out "$work/hf$suffix" >/dev/null
}
