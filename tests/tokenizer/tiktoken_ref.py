#!/usr/bin/env python3
"""Reference GPT-2 token ids from PyPI's tiktoken, built offline from a local
gpt2.tiktoken (GPT-2's pattern, <|endoftext|> = 50256), for meshtrain's tests
and benchmarks.

  tiktoken_ref.py encode --ranks R --out IDS FILE...
      IDS: for each FILE in order, int32 count then count int32 ids (little-endian),
      the encode_ordinary of the file's bytes decoded as UTF-8.
  tiktoken_ref.py sweep OUT
      writes a text holding every Unicode scalar value in a few contexts.
  tiktoken_ref.py bench --ranks R [--reps N] FILE...
      prints one line: MB/s of single-threaded encode_ordinary over the files.
"""
import argparse
import base64
import struct
import sys
import time

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def load_encoding(ranks_path):
    import tiktoken  # noqa: PLC0415 (only the commands that need it import it)

    ranks = {}
    with open(ranks_path, "rb") as f:
        for line in f.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="gpt2_local",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )


def read_text(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8")


def cmd_encode(args):
    enc = load_encoding(args.ranks)
    with open(args.out, "wb") as out:
        for path in args.files:
            ids = enc.encode_ordinary(read_text(path))
            out.write(struct.pack(f"<i{len(ids)}i", len(ids), *ids))


def cmd_sweep(args):
    # Each scalar value alone, doubled, after a space, between letters and
    # digits, and before whitespace: exercises every class in the pattern.
    # Every assigned code point; unassigned and private-use ones (all alike
    # to the pattern) sampled, to keep the text a few MB.
    import unicodedata  # noqa: PLC0415

    parts = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        if unicodedata.category(chr(cp)) in ("Cn", "Co") and cp % 61 != 0:
            continue
        c = chr(cp)
        parts.append(f"{c}{c} a{c}b 1{c}2 {c}  x'{c}\n")
    with open(args.out, "wb") as f:
        f.write("".join(parts).encode("utf-8"))


def cmd_bench(args):
    enc = load_encoding(args.ranks)
    texts = [read_text(p) for p in args.files]
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    for t in texts:  # warm-up: the first call builds tiktoken's regex state
        enc.encode_ordinary(t)
    best = float("inf")
    ntok = 0
    for _ in range(args.reps):
        start = time.perf_counter()
        ntok = sum(len(enc.encode_ordinary(t)) for t in texts)
        best = min(best, time.perf_counter() - start)
    print(f"tiktoken {nbytes / best / 1e6:.2f} MB/s ({nbytes} bytes, {ntok} tokens, best of {args.reps})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("encode")
    p.add_argument("--ranks", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("files", nargs="+")
    p.set_defaults(fn=cmd_encode)
    p = sub.add_parser("sweep")
    p.add_argument("out")
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("bench")
    p.add_argument("--ranks", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("files", nargs="+")
    p.set_defaults(fn=cmd_bench)
    args = parser.parse_args()
    try:
        args.fn(args)
    except ImportError as e:
        sys.exit(f"tiktoken_ref: {e} (install it: python3 -m pip install tiktoken)")


if __name__ == "__main__":
    main()
