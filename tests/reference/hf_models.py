#!/usr/bin/env python3
"""Tiny models written by transformers itself, for meshtrain's HF import test.

Writes, per case, <out>/hf_tiny_<case>/ with what save_pretrained makes
(config.json, model.safetensors or a sharded index) plus logits.safetensors:
the model's fp32 logits [T, V] for the ids (7 * t + 3) % vocab, t < T (tensor
"logits"). Needs torch, transformers and safetensors (scripts/setup_hf_venv.sh).

    build/hf-venv/bin/python tests/reference/hf_models.py --out tests/reference/fixtures [--only CASE]
"""
import argparse
import inspect
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

SEQ = 40  # positions past the llama3 case's original context (16)


def ids_for(vocab):
    return torch.tensor([[(7 * t + 3) % vocab for t in range(SEQ)]], dtype=torch.long)


def llama_config(theta, scaling=None, kv_heads=2, tied=False):
    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                  rms_norm_eps=1e-5, tie_word_embeddings=tied, attn_implementation="eager")
    # transformers >= 5 takes rope_parameters; earlier versions rope_theta + rope_scaling.
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        kwargs["rope_parameters"] = params
    else:
        kwargs["rope_theta"] = theta
        kwargs["rope_scaling"] = scaling
    return LlamaConfig(**kwargs)


def cases():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    yield "llama_theta1e4_gqa_untied", LlamaForCausalLM, llama_config(1e4), {}
    yield "llama_theta5e5_tied", LlamaForCausalLM, llama_config(5e5, kv_heads=4, tied=True), {}
    yield "llama_llama3_scaling", LlamaForCausalLM, llama_config(5e5, llama3), {}
    yield "llama_linear_scaling", LlamaForCausalLM, llama_config(1e4, {"rope_type": "linear", "factor": 2.0}), {}
    # bf16 weights, split over several files (model.safetensors.index.json).
    yield "llama_bf16_sharded", LlamaForCausalLM, llama_config(1e4), {"dtype": torch.bfloat16, "max_shard_size": "20KB"}
    gpt2 = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    yield "gpt2", GPT2LMHeadModel, gpt2, {}
    yield "gpt2_f16", GPT2LMHeadModel, gpt2, {"dtype": torch.float16}
    # A mixture of experts: 4 experts, top 2, save_pretrained's per-expert tensors.
    mixtral = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                            tie_word_embeddings=False, attn_implementation="eager")
    yield "mixtral", MixtralForCausalLM, mixtral, {}
    # Today's families: their attention options (q/k/v biases, QK-norm per head or over the
    # whole projection, a head_dim of its own) and MoE layouts (a gated shared expert, dense
    # layers among MoE ones, routing weights renormalised or not).
    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                  attn_implementation="eager")
    yield "qwen2", Qwen2ForCausalLM, Qwen2Config(intermediate_size=48, num_hidden_layers=2, **common), {}
    yield "qwen3", Qwen3ForCausalLM, Qwen3Config(intermediate_size=48, num_hidden_layers=2, head_dim=16,
                                                 **common), {}
    # Mistral's sliding window (8 of the 40 positions) and a head_dim of its own.
    yield "mistral_sliding", MistralForCausalLM, MistralConfig(
        intermediate_size=48, num_hidden_layers=2, head_dim=16, sliding_window=8, **common), {}
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.01)
    yield "qwen2_moe", Qwen2MoeForCausalLM, Qwen2MoeConfig(
        intermediate_size=48, num_hidden_layers=3, num_experts=4, shared_expert_intermediate_size=40,
        mlp_only_layers=[0], norm_topk_prob=False, **moe, **common), {}
    yield "qwen3_moe", Qwen3MoeForCausalLM, Qwen3MoeConfig(
        intermediate_size=48, num_hidden_layers=3, num_experts=4, head_dim=16, decoder_sparse_step=2,
        norm_topk_prob=True, **moe, **common), {}
    yield "olmoe", OlmoeForCausalLM, OlmoeConfig(
        intermediate_size=24, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, eos_token_id=None, pad_token_id=None, **common), {}


def random_model(cls, config):
    """A model with weights larger than the default init, so that RoPE and scaling differences
    show in the logits."""
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", help="write this case only")
    args = ap.parse_args()
    for i, (name, cls, config, opts) in enumerate(cases()):
        if args.only and name != args.only:
            continue
        torch.manual_seed(1000 + i)
        model = random_model(cls, config)
        dtype = opts.get("dtype")
        if dtype is not None:
            model = model.to(dtype)  # the stored weights; the logits below use them widened
        d = os.path.join(args.out, f"hf_tiny_{name}")
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
        save = {"safe_serialization": True}
        if "max_shard_size" in opts:
            save["max_shard_size"] = opts["max_shard_size"]
        model.save_pretrained(d, **save)
        model = model.float()
        with torch.no_grad():
            logits = model(ids_for(config.vocab_size)).logits[0].float().contiguous()
        save_file({"logits": logits}, os.path.join(d, "logits.safetensors"))
        print(f"{d}: transformers {transformers.__version__}, logits {list(logits.shape)}")


if __name__ == "__main__":
    main()
