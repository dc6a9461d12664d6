#!/usr/bin/env bash
# Inputs for the CLI tests in WORK_DIR: a byte-level corpus (train/val token
# files), broken token files, and a config for a tiny run.
# usage: make_inputs.sh WORK_DIR
set -euo pipefail
WORK=$1
rm -rf "$WORK"
mkdir -p "$WORK"
python3 - "$WORK" <<'PY'
import random, struct, sys
work = sys.argv[1]

def write(path, tokens, magic=20240520, version=1, count=None, header_ints=256):
    header = [magic, version, len(tokens) if count is None else count] + [0] * 253
    with open(f"{work}/{path}", "wb") as f:
        f.write(struct.pack("<256i", *header)[: 4 * header_ints])
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))

# A deterministic toy corpus: simple sentences, byte-level tokens.
rng = random.Random(7)
subjects = ["the king", "a shepherd", "the people", "my brother", "the prophet"]
verbs = ["went up to", "spake unto", "looked upon", "came into", "builded"]
objects = ["the city", "the mountain", "the temple", "his house", "the river"]
lines = [f"And {rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.\n" for _ in range(3000)]
text = "".join(lines).encode()
split = len(text) * 9 // 10
import os
os.makedirs(f"{work}/text")
for name, part in (("a", text[:split]), ("b", text[split:])):
    open(f"{work}/text/{name}.txt", "wb").write(part)
write("train.bin", list(text[:split]))
write("val.bin", list(text[split:]))

write("bad_magic.bin", [1, 2, 3], magic=12345)
write("bad_version.bin", [1, 2, 3], version=7)
write("truncated.bin", [1, 2, 3], count=1000)
write("short_header.bin", [], header_ints=10)
write("big_token.bin", [1, 2, 300, 4] * 100)
PY
cat >"$WORK/good.toml" <<TOML
[model]
preset = "llama-tiny"
[train]
steps = 30
batch_size = 8
micro_batch_size = 4
seq_len = 64
eval_interval = 15
eval_batches = 2
log_interval = 10
peak_flops = 1e11
checkpoint_interval = 15
out_dir = "$WORK/run"
[optim]
lr = 3e-3
warmup_steps = 3
[data]
train = "$WORK/train.bin"
val = "$WORK/val.bin"
tokenizer = "bytes"
TOML
sed 's/^steps = 30/stepz = 30/' "$WORK/good.toml" >"$WORK/unknown_key.toml"
sed 's/^steps = 30/steps = "30"/' "$WORK/good.toml" >"$WORK/bad_type.toml"
printf '[train]\nsteps = = 3\n' >"$WORK/syntax.toml"
echo "make_inputs: wrote $WORK"
