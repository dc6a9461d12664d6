#!/usr/bin/env bash
# Against transformers itself (needs build/hf-venv: scripts/setup_hf_venv.sh;
# exits 77, a ctest skip, without it):
#  1. tests/reference/hf_models.py writes tiny models with save_pretrained and
#     their logits; test_ckpt's HfTransformers tests import them and compare.
#  1b. tests/reference/peft_models.py writes LoRA adapters with peft; test_ckpt's
#     LoraExport.PeftFixtures* merges them as peft's merge_and_unload() does.
#  1c. The Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and OLMoE models read and
#     written back by meshtrain (per-expert tensors as save_pretrained writes them):
#     transformers loads each as its own architecture and gives its own logits.
#  2. A GPT-2-vocabulary model exported with the GPT-2 tokenizer: AutoTokenizer
#     loads the export folder and encodes and decodes as meshtrain does.
# usage: hf_venv_check.sh VENV_PYTHON TEST_CKPT MESHTRAIN WORK GPT2_RANKS
set -euo pipefail
py=$1 test_ckpt=$2 bin=$3 work=$4 ranks=$5
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -x "$py" ] || ! "$py" -c "import torch, transformers, safetensors" 2>/dev/null; then
  echo "SKIP: no venv with torch + transformers at $py (scripts/setup_hf_venv.sh)"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work/models"
"$py" "$here/hf_models.py" --out "$work/models"
MESHTRAIN_HF_FIXTURES="$work/models" "$test_ckpt" --gtest_filter='HfTransformers.*'
# 1b. LoRA adapters peft writes: merged by meshtrain as merge_and_unload() does.
if "$py" -c "import peft" 2>/dev/null; then
  (cd "$here" && "$py" peft_models.py --out "$work/models")
  MESHTRAIN_HF_FIXTURES="$work/models" "$test_ckpt" --gtest_filter='LoraExport.PeftFixtures*'
else
  echo "SKIP (peft part): no peft in the venv (scripts/setup_hf_venv.sh installs it)"
fi

# 1c. meshtrain's exports of each MoE and attention family, loaded by transformers.
for family in mixtral qwen2 qwen3 qwen2_moe qwen3_moe olmoe; do
  "$bin" ckpt import --format hf --in "$work/models/hf_tiny_$family" --out "$work/${family}_export"
  "$py" - "$work/${family}_export" "$work/models/hf_tiny_$family" <<'PY'
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager").eval()
want = json.load(open(sys.argv[2] + "/config.json"))["architectures"][0]
vocab = model.config.vocab_size
ids = torch.tensor([[(7 * t + 3) % vocab for t in range(40)]])
with torch.no_grad():
    logits = model(ids).logits[0]
ref = load_file(sys.argv[2] + "/logits.safetensors")["logits"]
err = ((logits - ref).norm() / ref.norm()).item()
assert type(model).__name__ == want and err <= 1e-6, (type(model).__name__, want, err)
print(f"ok: meshtrain's {want} export in transformers, logits rel err {err:.1e}")
PY
done

if [ ! -f "$ranks" ]; then
  echo "SKIP (tokenizer part): no GPT-2 ranks at $ranks"
  exit 0
fi
# A tiny random GPT-2 of the full vocabulary, through meshtrain with the tokenizer.
"$py" - "$work/gpt2_vocab" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_embd=8, n_layer=1, n_head=2, n_positions=64)).save_pretrained(sys.argv[1])
PY
"$bin" ckpt import --format hf --in "$work/gpt2_vocab" --out "$work/export" --tokenizer gpt2 --gpt2-ranks "$ranks"
texts=("Hello world, it's a test." "  spaces   and\ttabs\nnewlines 123 4567" "naïve café — 日本語 🙂" "Numbers: 3.14159, 2026-12-01; code: x+=1 && y--")
for text in "${texts[@]}"; do
  ours=$("$bin" sample --checkpoint "$work/export" --tokenizer gpt2 --gpt2-ranks "$ranks" --prompt "$text" --max-new-tokens 0 --print-ids | head -1)
  "$py" - "$work/export" "$text" "$ours" <<'PY'
import sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
text, ours = sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
theirs = tok.encode(text, add_special_tokens=False)
assert theirs == ours, f"{text!r}: transformers {theirs} != meshtrain {ours}"
assert tok.decode(ours) == text, f"decode {tok.decode(ours)!r} != {text!r}"
assert tok.eos_token_id == 50256 and tok.bos_token_id == 50256, (tok.bos_token_id, tok.eos_token_id)
print(f"ok: {text!r} -> {len(ours)} ids")
PY
done
echo PASS
