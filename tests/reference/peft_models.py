#!/usr/bin/env python3
"""Tiny LoRA adapters written by PyPI peft itself, for meshtrain's PEFT import/merge test.

Writes, per case, <out>/peft_tiny_<case>/ with
  base/      a tiny random model (transformers save_pretrained, fp32)
  adapter/   peft's save_pretrained of a LoRA adapter on it, A and B random (B non-zero)
  merged.safetensors  merge_and_unload()'s state dict (the base with the adapters merged)
  logits.safetensors  PeftModel's fp32 logits [T, V] ("logits") for ids (7 t + 3) % vocab
Llama (GQA: q/k rows in HF's rotate_half order) and GPT-2 (Conv1D, fan_in_fan_out).
Needs torch, transformers, safetensors and peft (scripts/setup_hf_venv.sh).

    build/hf-venv/bin/python tests/reference/peft_models.py --out tests/reference/fixtures
"""
import argparse
import os
import shutil

import peft
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from hf_models import ids_for, llama_config, random_model


def cases():
    yield ("llama", LlamaForCausalLM, llama_config(1e4),
           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]))
    gpt2 = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    yield ("gpt2", GPT2LMHeadModel, gpt2,
           LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0, task_type="CAUSAL_LM", fan_in_fan_out=True,
                      target_modules=["c_attn", "c_proj", "c_fc"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for i, (name, cls, config, lora) in enumerate(cases()):
        torch.manual_seed(2000 + i)
        model = random_model(cls, config)
        d = os.path.join(args.out, f"peft_tiny_{name}")
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(os.path.join(d, "base"), safe_serialization=True)
        model = get_peft_model(model, lora).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_A" in n or "lora_B" in n:
                    p.normal_(0.0, 0.3)  # PEFT initialises B to zero: make the adapter matter
        model.save_pretrained(os.path.join(d, "adapter"))
        os.remove(os.path.join(d, "adapter", "README.md"))  # peft's model card
        with torch.no_grad():
            logits = model(ids_for(config.vocab_size)).logits[0].float().contiguous()
        save_file({"logits": logits}, os.path.join(d, "logits.safetensors"))
        merged = model.merge_and_unload()
        state = {k: v.contiguous() for k, v in merged.state_dict().items()
                 if not k.endswith(".attn.bias") and not k.endswith(".masked_bias")}
        if getattr(config, "tie_word_embeddings", True) and "lm_head.weight" in state:
            del state["lm_head.weight"]  # tied: the embedding's copy
        save_file(state, os.path.join(d, "merged.safetensors"), metadata={"format": "pt"})
        print(f"{d}: peft {peft.__version__}, logits {list(logits.shape)}, {len(state)} merged tensors")


if __name__ == "__main__":
    main()
