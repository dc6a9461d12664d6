"""Makes the committed tokenizer fixtures (tests/tokenizer/vocab/*.json.xz).

Real vocabularies from a registry package: llama.cpp's models/ggml-vocab-*.gguf
in PyPI's llama-cpp-python 0.3.36 source distribution (the vocabularies of the
models' own Hugging Face tokenizers; llama.cpp's convert_hf_to_gguf_update.py
wrote them), converted back to tokenizer.json by transformers' GGUF loader
(AutoTokenizer.from_pretrained(..., gguf_file=...)). The GPT-2, Qwen2 and
Phi-3 conversions reproduce the ids llama.cpp recorded from the original
Hugging Face tokenizers (ggml-vocab-*.gguf.out) on all 46 of its cases
(ctest tokenizer.hf_originals).

Pipelines: the conversions as transformers writes them, plus the pipelines of
today's families that the GGUF files lose or that no permissively licensed
vocabulary here carries, each on a real vocabulary (README.md says which).

Run once by a developer, in a venv with transformers, gguf and sentencepiece:
  python tests/tokenizer/vocab/make_fixtures.py [--sdist PATH]
"""
import argparse
import copy
import hashlib
import json
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def fetch(sdist):
    if sdist is None:
        d = tempfile.mkdtemp()
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--no-binary", ":all:", "llama-cpp-python==0.3.36", "-d", d])
        sdist = os.path.join(d, SDIST)
    digest = hashlib.sha256(open(sdist, "rb").read()).hexdigest()
    assert digest == SDIST_SHA256, f"{sdist}: sha256 {digest}"
    out = tempfile.mkdtemp()
    with tarfile.open(sdist) as t:
        for m in t.getmembers():
            if "/models/ggml-vocab-" in m.name or m.name.endswith("llama.cpp/LICENSE"):
                m.name = os.path.basename(m.name)
                t.extract(m, out)
    return out


def convert(models, name):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models, gguf_file=f"ggml-vocab-{name}.gguf")
    d = tempfile.mkdtemp()
    tok.save_pretrained(d)
    j = json.load(open(os.path.join(d, "tokenizer.json")))
    cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
    return j, {k: cfg[k] for k in ("bos_token", "eos_token") if cfg.get(k)}


def write(name, tokenizer, config):
    with lzma.open(os.path.join(HERE, f"{name}.tokenizer.json.xz"), "wt", preset=9) as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    write_config(name, config)


def write_config(name, config):
    with open(os.path.join(HERE, f"{name}.tokenizer_config.json"), "w") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
        f.write("\n")


def write_variant(name, base, config, changes):
    """A pipeline on `base`'s vocabulary: unpack.py sets each dotted key."""
    with open(os.path.join(HERE, f"{name}.variant.json"), "w") as f:
        json.dump({"base": base, "set": changes}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    write_config(name, config)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist")
    models = fetch(ap.parse_args().sdist)
    gpt2, gpt2_cfg = convert(models, "gpt-2")
    qwen2, qwen2_cfg = convert(models, "qwen2")
    phi3, phi3_cfg = convert(models, "phi-3")
    spm, _ = convert(models, "llama-spm")

    write("gpt2", gpt2, gpt2_cfg)
    # SmolLM2 / StarCoder: digits one by one before GPT-2's ByteLevel.
    write_variant("gpt2-digits", "gpt2", gpt2_cfg, {"pre_tokenizer": {
        "type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, gpt2["pre_tokenizer"]]}})
    # Qwen2 / Qwen2.5: their tokenizer.json normalizes to NFC (the GGUF file drops it).
    qwen2["normalizer"] = {"type": "NFC"}
    write("qwen2", qwen2, qwen2_cfg)
    # Llama 3: its regex (digits in threes), ignore_merges, a BOS template.
    pre = copy.deepcopy(qwen2["pre_tokenizer"])
    pre["pretokenizers"][0]["pattern"] = {"Regex": LLAMA3_REGEX}
    bos = {"id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]}
    write_variant("qwen2-llama3", "qwen2", {"eos_token": "<|im_end|>"}, {
        "normalizer": None, "pre_tokenizer": pre, "model.ignore_merges": True,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": bos}}})
    # Llama 2 / Mistral v0.1 as their tokenizer.json: Prepend + Replace normalizer,
    # byte fallback (Phi-3 keeps that pipeline).
    write("phi3", phi3, phi3_cfg)
    # Llama 2 / Mistral as newer transformers convert them: Metaspace.
    write_variant("phi3-metaspace", "phi3", phi3_cfg,
                  {key: spm[key] for key in ("normalizer", "pre_tokenizer", "decoder")})
    print("wrote fixtures to", HERE)


if __name__ == "__main__":
    main()
