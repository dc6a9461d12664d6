# Sourced by the benchmarks that train llama-60M under mpirun (zero_stages.sh,
# pipeline_schedules.sh, ddp_vs_torch.sh) from the repository root: BIN,
# MPIRUN (1 thread per rank), a scratch directory $work (kept and printed with
# KEEP=1), random_tokens and write_run_config; for those against a Hugging
# Face peer (finetune.sh, dpo.sh): pin_binary, hf_peer_env, finetune_train_keys
# and make_hf.
BIN=${MESHTRAIN_BIN:-build/meshtrain}
[ -x "$BIN" ] || { echo "build first (or set MESHTRAIN_BIN)" >&2; exit 1; }
MPIRUN=(mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi
work=$(mktemp -d)
if [ -n "${KEEP:-}" ]; then echo "runs in $work" >&2; else trap 'rm -rf "$work"' EXIT; fi

# random_tokens COUNT [VOCAB=50257] [SEED=1]: $work/train.bin, COUNT random token ids
# below VOCAB (GPT-2's by default) in llm.c's format (throughput only).
random_tokens() {
  python3 tests/support/random_tokens.py "$work/train.bin" "$1" "${2:-50257}" "${3:-1}"
}

# write_run_config < KEYS: $work/run.toml, llama-60M on $work/train.bin at
# sequence 256, 1 thread, no evaluation or checkpoints; stdin adds [train] keys
# (steps, batch sizes, precision) and may then open other tables.
write_run_config() {
  {
    cat <<TOML
[model]
preset = "llama-60M"
[train]
seq_len = 256
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
TOML
    cat
    printf '[data]\ntrain = "%s"\n' "$work/train.bin"
  } >"$work/run.toml"
}

# pin_binary: runs the whole bench on one copy of $BIN (in $work), whatever is
# rebuilt meanwhile; says which build and tree it is.
pin_binary() {
  echo "meshtrain: $BIN of $(date -r "$BIN" '+%F %T'), tree at $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo ' + uncommitted src changes')" >&2
  cp "$BIN" "$work/meshtrain" && BIN=$work/meshtrain
}

# hf_peer_env THREADS MODULES: VENV_PY, the peer's python (build/hf-venv, or
# $MESHTRAIN_HF_VENV), and have_venv=1 when it imports MODULES ("a, b");
# OMP_NUM_THREADS=THREADS for both sides. As train_vs_torch.sh: an OpenBLAS
# that misdetects this VM gets the AVX-512 kernel (PyPI's torch computes with
# oneDNN / MKL; harmless there).
hf_peer_env() {
  VENV_PY=${MESHTRAIN_HF_VENV:-build/hf-venv}/bin/python
  have_venv=0
  if [ -x "$VENV_PY" ] && "$VENV_PY" -c "import $2" 2>/dev/null; then have_venv=1; fi
  export OMP_NUM_THREADS=$1
  if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -q avx512f /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=SkylakeX
  fi
}

# parse_round_options ARGS...: the options of the fine-tuning benches (dpo.sh, finetune.sh):
# --steps N (or a bare N), --steps-large, --warmup, --models, --methods, --rounds, --no-peer,
# --cache into STEPS, STEPS_LARGE, WARMUP, MODELS, METHODS, ROUNDS, PEER, CACHE; a script's own
# options go to its round_option NAME VALUE (returns non-zero for an unknown one). Anything else
# prints the script's usage and exits 2.
parse_round_options() {
  while [ $# -gt 0 ]; do
    case $1 in
      --steps) STEPS=$2; shift 2 ;;
      --steps-large) STEPS_LARGE=$2; shift 2 ;;
      --warmup) WARMUP=$2; shift 2 ;;
      --models) MODELS=$2; shift 2 ;;
      --methods) METHODS=$2; shift 2 ;;
      --rounds) ROUNDS=$2; shift 2 ;;
      --no-peer) PEER=0; shift ;;
      --cache) CACHE=$2; shift 2 ;;
      [0-9]*) STEPS=$1; shift ;;
      *)
        if [ $# -ge 2 ] && round_option "$1" "$2"; then
          shift 2
        else
          sed -n '/^# usage/,/^# Time/p' "$0" >&2
          exit 2
        fi ;;
    esac
  done
}

# finetune_train_keys WARMUP STEPS BATCH OUT_DIR: the [train] keys (the table
# already open) and [optim] of the fine-tuning benches' runs: bf16, seq 256,
# 2 threads, no evaluation or checkpoints, WARMUP + STEPS steps of BATCH rows
# (one micro-batch), the STEPS after the warm-up traced; AdamW lr 1e-4.
finetune_train_keys() {
  cat <<TOML
precision = "bf16"
steps = $(($1 + $2))
batch_size = $3
micro_batch_size = $3
seq_len = 256
threads = 2
eval_interval = 0
log_interval = 1
peak_flops = 1e11
checkpoint_interval = -1
trace_steps = "$(($1 + 1))-$(($1 + $2))"
out_dir = "$4"
[optim]
lr = 1e-4
warmup_steps = 0
TOML
}

# make_hf 100m|500m: $models_dir/hf_NAME, a Hugging Face Llama as transformers
# writes it (bf16, untied vocabulary 32000, GQA, seed 0), and
# $models_dir/imported_NAME, its meshtrain import (both kept when present):
#   100m  dim 768,  8 layers, 12/4 heads, MLP 2048  (99.7M parameters)
#   500m  dim 1536, 16 layers, 12/4 heads, MLP 4096 (501M parameters)
make_hf() {
  local name=$1 shape
  case $name in
    100m) shape="768 8 12 4 2048" ;;
    500m) shape="1536 16 12 4 4096" ;;
    *) echo "make_hf: unknown model $name (100m, 500m)" >&2; return 2 ;;
  esac
  if [ ! -f "$models_dir/hf_$name/config.json" ]; then
    # shellcheck disable=SC2086  # the shape's five numbers
    "$VENV_PY" - "$models_dir/hf_$name" $shape <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
dim, layers, heads, kv, mlp = map(int, sys.argv[2:7])
c = LlamaConfig(vocab_size=32000, hidden_size=dim, intermediate_size=mlp, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512,
                tie_word_embeddings=False)
LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
  fi
  if [ ! -f "$models_dir/imported_$name/config.json" ]; then
    "$BIN" ckpt import --format hf --in "$models_dir/hf_$name" --out "$models_dir/imported_$name" \
      --dtype bf16 >/dev/null 2>&1
  fi
}
