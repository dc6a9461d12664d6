#!/usr/bin/env python3
"""Hand-made seed inputs for the harnesses (fuzz/corpus/<harness>/seed_*):
small valid files in each reader's format, written from the format's
description (the headers in src/meshtrain), plus a few edge cases
(docs/fuzzing.md). Deterministic: `python3 fuzz/make_seeds.py`."""
import base64
import json
import os
import random
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
rng = random.Random(0)


def put(harness, name, data):
    d = os.path.join(ROOT, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed_" + name), "wb") as f:
        f.write(data)


def floats(n):
    return struct.pack(f"<{n}f", *[rng.uniform(-0.1, 0.1) for _ in range(n)])


# token_file: 256 int32 (magic 20240520, version 1, count), uint16 tokens.
def token_file(tokens, count=None, magic=20240520, version=1):
    head = [magic, version, len(tokens) if count is None else count] + [0] * 253
    return struct.pack("<256i", *head) + struct.pack(f"<{len(tokens)}H", *tokens)


put("token_file", "bytes", token_file([rng.randrange(256) for _ in range(64)]))
put("token_file", "gpt2", token_file([rng.randrange(50257) for _ in range(32)]))
put("token_file", "empty", token_file([]))
put("token_file", "count_past_end", token_file([1, 2, 3], count=1000))


# safetensors: u64 header length, JSON header, data.
def safetensors(tensors, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


put("safetensors", "mixed", safetensors([
    ("w", "F32", [2, 3], floats(6)),
    ("b", "BF16", [4], struct.pack("<4H", 0x3f80, 0x4000, 0xbf80, 0)),
    ("h", "F16", [2], struct.pack("<2H", 0x3c00, 0x4000)),
    ("d", "F64", [1], struct.pack("<d", 1.5)),
    ("step", "I64", [1], struct.pack("<q", 7)),
    ("rng", "I32", [2], struct.pack("<2i", 1, -1)),
], {"format": "pt"}))
put("safetensors", "scalar_and_empty", safetensors([("s", "F32", [], floats(1)), ("e", "F32", [0, 4], b"")]))

# gpt2_ranks: tiktoken lines "<base64> <rank>": every byte, then a few merges.
lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
for i, tok in enumerate([b"He", b"ll", b"llo", b"Hello", b" w", b"or", b"ld", b" wor", b" world", b"20", b"24"]):
    lines.append(f"{base64.b64encode(tok).decode()} {256 + i}")
put("gpt2_ranks", "small", "\n".join(lines) + "\n")
put("gpt2_ranks", "bytes_only", "\n".join(lines[:256]) + "\n")

# sft_jsonl: first byte = options (seq_len, pack, truncate, shuffle), then JSONL.
records = [
    {"prompt": "What is 2+2?", "response": "4"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}]},
    {"prompt": "A long prompt " * 4, "response": "and a long answer " * 3},
]
jsonl = "\n".join(json.dumps(r) for r in records) + "\n"
put("sft_jsonl", "packed", bytes([0x7f]) + jsonl.encode())
put("sft_jsonl", "unpacked", bytes([0x7a]) + jsonl.encode())
put("sft_jsonl", "refuse_long", bytes([0x11]) + jsonl.encode())

# flight_dump: two ranks' records (NUL between), rank 1 behind on "world".
def dump(rank, issued, calls):
    return json.dumps({
        "format": "meshtrain flight record 1", "job": "job1", "rank": rank, "world_size": 2,
        "reason": "timeout", "host": "h", "pid": 100 + rank, "marker_age_s": 0.5,
        "comms": [{"name": "world", "members": [0, 1], "rank": rank, "issued": issued,
                   "first_unfinished": issued - 1 if calls and calls[-1][1] != "done" else issued},
                  {"name": "dp", "members": [0, 1], "rank": rank, "issued": 2, "first_unfinished": 2}],
        "calls": [{"comm": 0, "seq": seq, "op": "all_reduce", "dtype": "f32", "bytes": 4096, "peer": -1,
                   "state": state, "submitted_ago_s": 30.0, "started_ago_s": 29.5,
                   "finished_ago_s": 29.0 if state == "done" else -1, "timeout_s": 10.0}
                  for seq, state in calls]}, indent=1)


put("flight_dump", "two_ranks", dump(0, 5, [(3, "done"), (4, "running")]) + "\0" + dump(1, 4, [(3, "done")]))
put("flight_dump", "one_rank", dump(0, 5, [(4, "queued")]))

# hf_config: transformers' config.json for a tiny Llama and a tiny GPT-2.
put("hf_config", "llama", json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 0}, indent=2))
put("hf_config", "llama3_rope", json.dumps({
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 1024,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 256}}))
put("hf_config", "gpt2", json.dumps({
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
    "vocab_size": 256, "n_positions": 128, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}))

# hf_index: the weight_map of the harness's two shards (a tiny untied Llama).
names = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
         "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
         "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
         "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
         "model.norm.weight", "lm_head.weight"]
put("hf_index", "two_shards", json.dumps({"metadata": {"total_size": 4096}, "weight_map": {
    n: f"model-0000{1 if i < len(names) // 2 else 2}-of-00002.safetensors" for i, n in enumerate(names)}}, indent=2))

# peft_adapter: adapter_config.json as PEFT (and export_peft) writes it.
peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": 2,
        "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "fan_in_fan_out": False,
        "bias": "none", "modules_to_save": None, "layers_to_transform": None, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "inference_mode": True}
put("peft_adapter", "export_peft", json.dumps(peft, indent=2))
put("peft_adapter", "rank_pattern", json.dumps(dict(peft, rank_pattern={"q_proj": 4}, target_modules="all-linear")))


# llama2c_model: v0 header (dim, hidden, layers, heads, kv_heads, +-vocab, seq), weights, RoPE table.
def llama2c(dim, hidden, layers, heads, kv, vocab, seq):
    hd, kvd = dim // heads, dim // heads * kv
    n = abs(vocab) * dim + layers * (2 * dim + 2 * dim * dim + 2 * dim * kvd + 3 * dim * hidden) + dim
    n += seq * hd  # freq_cis_real and _imag
    if vocab < 0:
        n += abs(vocab) * dim
    return struct.pack("<7i", dim, hidden, layers, heads, kv, vocab, seq) + floats(n)


put("llama2c_model", "tied", llama2c(8, 16, 1, 2, 1, 16, 8))
put("llama2c_model", "untied", llama2c(8, 12, 2, 2, 2, -16, 4))


# llmc_model: 256 int32 (magic 20240326, version 3 f32 / 5 bf16, maxT, V, L, NH, C, Vp), then params.
def llmc(maxT, V, L, NH, C, version=3):
    Vp = (V + 127) // 128 * 128
    n = Vp * C + maxT * C + L * (2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C) + 2 * C
    head = struct.pack("<256i", 20240326, version, maxT, V, L, NH, C, Vp, *([0] * 248))
    if version == 3:
        return head + floats(n)
    return head + struct.pack(f"<{n}H", *[rng.randrange(0x3c00, 0x3d00) for _ in range(n)])


put("llmc_model", "f32", llmc(8, 16, 1, 2, 8))
put("llmc_model", "bf16", llmc(4, 20, 1, 1, 4, version=5))


# llama2c_tokenizer: the 4-byte vocabulary prefix, then int32 max_token_length and tokens.
def llama2c_tok(tokens, vocab):
    out = struct.pack("<I", vocab) + struct.pack("<i", max(len(t) for t in tokens))
    for i, t in enumerate(tokens):
        out += struct.pack("<fi", -float(i), len(t)) + t
    return out + b"".join(struct.pack("<fi", 0.0, 0) for _ in range(vocab - len(tokens)))


toks = [bytes([b]) for b in range(256)] + [b"he", b"llo", b" world"]
put("llama2c_tokenizer", "bytes_plus", llama2c_tok(toks, len(toks)))
put("llama2c_tokenizer", "padded", llama2c_tok(toks[:8], 12))


# llmc_tokenizer: 256 uint32 (magic 20240328, version 2, vocab, eot), then uint8 length + bytes.
def llmc_tok(tokens, eot, version=2):
    head = [20240328, version, len(tokens), eot] + [0] * 252
    return struct.pack("<256I", *head) + b"".join(bytes([len(t)]) + t for t in tokens)


put("llmc_tokenizer", "v2", llmc_tok(toks + [b"<|endoftext|>"], len(toks)))
put("llmc_tokenizer", "v1", llmc_tok(toks[:16], 0, version=1))

# config_overrides: "section.key=value" lines.
put("config_overrides", "common", "train.steps=20\noptim.lr=1e-3\nmodel.dim=32\ndata.tokenizer=bytes\n")
put("config_overrides", "parallel", "parallel.tp=2\nparallel.pp=2\nparallel.zero=1\ntrain.precision=bf16\n")
put("config_overrides", "lora", "lora.rank=4\nlora.targets=[\"q_proj\"]\ncomm.timeout_s=5\n")

# train_state: a whole-tensor checkpoint's train_state.json; its config is
# configs/llama-tiny-bytes.toml as JSON (config_to_json's shape: TOML's tables).
import tomllib

with open(os.path.join(os.path.dirname(ROOT), "..", "configs", "llama-tiny-bytes.toml"), "rb") as f:
    config = tomllib.load(f)
state = {"format": "meshtrain-train-state", "version": 1, "step": 10, "optimizer_step": 9,
         "sampler": {"epoch": 0, "index": 640}, "seed": 1337, "config": config,
         "update_gates": {"loss_scale": 65536.0, "skipped": 1}}
put("train_state", "llama_tiny", json.dumps(state, indent=1))
put("train_state", "no_gates", json.dumps({k: v for k, v in state.items() if k != "update_gates"}))


# manifest: a one-rank checkpoint of a [2, 3] and a [4] tensor, the first split in two
# row blocks (the harness recomputes manifest_xxh3).
def shards(shape, blocks):
    out = []
    for state_kind in ["master", "exp_avg", "exp_avg_sq"]:
        flat = 0
        for offset, extent in blocks:
            n = 1
            for e in extent:
                n *= e
            out.append({"file": "rank_0.safetensors", "key": f"{state_kind}.{flat}", "state": state_kind,
                        "offset": offset, "extent": extent, "flat_begin": 0, "flat_end": n})
            flat += n
    return out


manifest = {"format": "meshtrain-dist-ckpt", "version": 1, "step": 10, "world": 1, "save_id": "seed",
            "layout": {"dp": 1, "tp": 1, "pp": 1, "zero": 0}, "meta": state,
            "files": [{"name": "rank_0.safetensors", "bytes": 240, "xxh3": "0123456789abcdef"},
                      {"name": "gpt2.tiktoken", "bytes": 10, "xxh3": "fedcba9876543210"}],
            "tensors": [{"name": "w", "shape": [2, 3], "dtype": "F32",
                         "shards": shards([2, 3], [([0, 0], [1, 3]), ([1, 0], [1, 3])])},
                        {"name": "b", "shape": [4], "dtype": "F32", "shards": shards([4], [([0], [4])])}],
            "manifest_xxh3": "0000000000000000"}
put("manifest", "one_rank", json.dumps(manifest, indent=1))
view = json.loads(json.dumps(manifest))
for s in view["tensors"][0]["shards"]:
    s["view"] = [6]
    s["offset"], s["extent"] = ([0], [3]) if s["offset"] == [0, 0] else ([3], [3])
put("manifest", "view", json.dumps(view))
