"""Random conversations (combining marks, scripts, emoji, runs of spaces and newlines) through
`meshtrain tokenize --chat --mask` and transformers' apply_chat_template(...,
return_assistant_tokens_mask=True): the ids and masks must be equal, for several real
vocabularies with TRL's Qwen2.5 training template (its {% generation %} blocks). Normalizers that
rewrite the text (Qwen2's NFC reorders and decomposes) exercise token_offsets' resynchronisation.

usage (build/hf-venv): random_masks_check.py MESHTRAIN VOCAB_DIR TEMPLATE WORK_DIR COUNT
"""
import json
import os
import random
import subprocess
import sys

from transformers import AutoTokenizer

POOLS = [range(0x20, 0x7f), range(0xa0, 0x250), range(0x300, 0x370), range(0x400, 0x4ff),
         range(0x590, 0x6ff), range(0x900, 0x97f), range(0x3040, 0x30ff), range(0x4e00, 0x4f00),
         range(0xac00, 0xac40), range(0x1f300, 0x1f64f),
         [0x20, 0x20, 0x9, 0xa, 0xa, 0x200d, 0xfe0f, 0x301, 0x308]]
# Each vocabulary's end-of-sequence token (the template writes ChatML's own as text where absent).
EOS = {"qwen2": "<|im_end|>", "qwen2-llama3": "<|im_end|>", "gpt2": "<|endoftext|>", "phi3": "</s>"}


def main():
    meshtrain, vocab, template, work, count = sys.argv[1:]
    rng = random.Random(17)

    def text():
        return "".join(chr(rng.choice(rng.choice(POOLS))) for _ in range(rng.randint(1, 60)))

    failures = 0
    for name, eos in EOS.items():
        folder = os.path.join(work, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(vocab, name, "tokenizer.json"), "rb") as f:
            open(os.path.join(folder, "tokenizer.json"), "wb").write(f.read())
        with open(template, encoding="utf-8") as f:
            config = {"eos_token": eos, "chat_template": f.read()}
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        tok = AutoTokenizer.from_pretrained(folder)
        bad = 0
        for _ in range(int(count)):
            conv = [{"role": r, "content": text()} for r in ("user", "assistant", "user", "assistant")]
            out = subprocess.run([meshtrain, "tokenize", "--tokenizer", folder, "--chat", "--mask"],
                                 input=json.dumps(conv).encode(), capture_output=True)
            want = tok.apply_chat_template(conv, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
            lines = out.stdout.decode().splitlines()
            got = [[int(x) for x in line.split()] for line in lines] if out.returncode == 0 else None
            if got != [list(want["input_ids"]), list(want["assistant_masks"])]:
                bad += 1
                if bad == 1:
                    print(f"{name}: differs on {json.dumps(conv)}: {out.stderr.decode().strip()}")
        print(f"{name}: {int(count) - bad} of {count} random conversations equal transformers' ids and masks")
        failures += bad
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
