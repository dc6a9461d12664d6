#!/usr/bin/env python3
"""Byte-level tokens (vocab 256, one token per byte) of text files, written in
the llm.c token-file format: a header of 256 little-endian int32 (magic
20240520, version 1, token count) then uint16 tokens. Documents (files) are
joined with a blank line. The last `--val-docs` documents form the validation
file. Stdlib only; a stand-in until `meshtrain prepare` (GPT-2 BPE) lands.

usage: bytes_to_tokens.py TEXT_DIR OUT_PREFIX [--val-docs N]
writes OUT_PREFIX_train.bin and OUT_PREFIX_val.bin
"""
import argparse
import array
import pathlib
import struct
import sys


def write_tokens(path, data):
    tokens = array.array("H", list(data))
    if sys.byteorder != "little":
        tokens.byteswap()
    header = struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253))
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(tokens.tobytes())
    tmp.replace(path)
    print(f"bytes_to_tokens: {path}: {len(tokens):,} tokens")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("text_dir", type=pathlib.Path)
    parser.add_argument("out_prefix")
    parser.add_argument("--val-docs", type=int, default=1)
    args = parser.parse_args()
    docs = sorted(args.text_dir.glob("*.txt"))
    if len(docs) <= args.val_docs:
        sys.exit(f"bytes_to_tokens: {args.text_dir}: need more than {args.val_docs} .txt files")
    split = len(docs) - args.val_docs
    for name, part in (("train", docs[:split]), ("val", docs[split:])):
        data = b"\n\n".join(p.read_bytes() for p in part)
        out = pathlib.Path(f"{args.out_prefix}_{name}.bin")
        out.parent.mkdir(parents=True, exist_ok=True)
        write_tokens(out, data)


if __name__ == "__main__":
    main()
