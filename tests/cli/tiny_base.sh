# Sourced by the fine-tuning CLI tests: tiny_base MESHTRAIN WORK_DIR FIXTURES trains llama-tiny
# for 2 steps on the SFT fixture (WORK_DIR/base) and exports it as a Hugging Face directory,
# WORK_DIR/hf: the base model the fine-tunes start from.
tiny_base() {
  local bin=$1 work=$2 fixtures=$3
  cat >"$work/base.toml" <<TOML
[model]
preset = "llama-tiny"
[train]
steps = 2
batch_size = 4
seq_len = 128
eval_interval = 0
peak_flops = 1e11
out_dir = "$work/base"
[data]
format = "sft-jsonl"
tokenizer = "bytes"
train = "$fixtures/sft_tiny.jsonl"
TOML
  "$bin" train --config "$work/base.toml" >/dev/null
  "$bin" ckpt export --format hf --checkpoint "$work/base/step_2" --out "$work/hf" >/dev/null
}
