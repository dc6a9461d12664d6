"""A model folder for the chat SFT tests: a tokenizer.json, and a tokenizer_config.json whose
chat_template is a template file. Standard library only.
usage: make_model_folder.py TOKENIZER_JSON TEMPLATE OUT_DIR"""
import json
import os
import shutil
import sys

tokenizer_json, template, out = sys.argv[1:]
os.makedirs(out, exist_ok=True)
shutil.copy(tokenizer_json, os.path.join(out, "tokenizer.json"))
with open(template, encoding="utf-8") as f:
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": f.read()}
with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, ensure_ascii=False, indent=1)
