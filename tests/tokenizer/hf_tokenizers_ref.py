#!/usr/bin/env python3
"""Reference ids from PyPI's tokenizers (the Rust library behind transformers'
fast tokenizers) for a tokenizer.json, and from PyPI's sentencepiece for a
folder with a tokenizer.model (add_special_tokens: its BOS first), for
meshtrain's HfTokenizer / SpmTokenizer tests and benchmarks.

  hf_tokenizers_ref.py cases --tokenizer DIR --out FILE [--text FILE...] [--llama-cpp FILE]
      FILE: for each case, in order: uint8 set, uint32 byte count, the text's
      UTF-8 bytes; then uint32 count and int32 ids of encode(text,
      add_special_tokens=False); for sets 3 and 4 also uint32 count and int32
      ids of encode(text, add_special_tokens=True); uint32 byte count and the
      UTF-8 bytes of decode(ids, skip_special_tokens=False). Little-endian.
      The sets:
        0 every Unicode scalar value alone (U+0001..U+10FFFF, no surrogates);
        1 every scalar value in context: runs of 16 consecutive ones, spaced and
          joined, after a letter and before a newline;
        2 random valid UTF-8 (seeded): ASCII, whitespace runs, digits, Latin,
          CJK, emoji, combining marks and any scalar value, mixed;
        3 llama.cpp's tokenizer edge cases (spaces, tabs, newline runs, digits,
          emoji, mixed scripts, special-token text);
        4 each --text file whole (long natural text).
  hf_tokenizers_ref.py bench --tokenizer DIR [--threads N] [--reps R] [--batch] FILE...
      prints one line: MB/s and tokens/s (best of R) of encoding each file as
      one text; --batch: all files in one encode_batch (tokenizers' thread
      pool, or sentencepiece's num_threads, of N threads).
  hf_tokenizers_ref.py gaps --out FILE
      writes the code points whose Unicode data differ between tokenizers and
      the libraries meshtrain runs on (docs/tokenizers.md, "Unicode versions"):
      NFC results that differ from libutf8proc's (tokenizers' NFC tables are
      older than Unicode 11), and \p{L} / \p{N} / \s memberships of
      tokenizers' Oniguruma that differ from Unicode 14 (PCRE2 10.42's
      version, and Python 3.11's unicodedata).
"""
import argparse
import array
import os
import random
import struct
import sys
import time


class SentencePiece:
    """tokenizers' batch interface over a sentencepiece model."""

    class Encoding:
        def __init__(self, ids):
            self.ids = ids

    def __init__(self, path):
        import sentencepiece  # noqa: PLC0415

        self.sp = sentencepiece.SentencePieceProcessor(model_file=path)

    def encode_batch(self, texts, add_special_tokens):
        bos = [self.sp.bos_id()] if add_special_tokens and self.sp.bos_id() >= 0 else []
        return [self.Encoding(bos + ids) for ids in self.sp.encode(texts)]

    def encode(self, text, add_special_tokens):
        return self.encode_batch([text], add_special_tokens)[0]

    def decode_batch(self, ids, skip_special_tokens):
        return self.sp.decode(ids)


def load(path):
    from tokenizers import Tokenizer  # noqa: PLC0415

    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "tokenizer.json")):
        return SentencePiece(os.path.join(path, "tokenizer.model"))
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def scalar_values():
    return [c for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]


def random_texts(n, seed=1234):
    rng = random.Random(seed)
    pools = [
        lambda: chr(rng.randrange(0x20, 0x7F)),
        lambda: rng.choice([" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u3000", "\u00a0", "\u2009",
                            "\u0085", " \n "]),
        lambda: str(rng.randrange(0, 10000)),
        lambda: chr(rng.randrange(0xA0, 0x250)),
        lambda: chr(rng.randrange(0x4E00, 0xA000)),
        lambda: chr(rng.randrange(0x1F300, 0x1FB00)),
        lambda: chr(rng.choice(SCALARS)),
        lambda: chr(rng.randrange(0x300, 0x370)),
    ]
    out = []
    for _ in range(n):
        k = rng.randrange(1, 120)
        out.append("".join(pools[rng.randrange(len(pools))]() for _ in range(k)))
    return out


SCALARS = scalar_values()


def cases(args):
    sets = [(0, [chr(c) for c in SCALARS])]
    runs = []
    for start in range(0, len(SCALARS), 16):
        chars = [chr(c) for c in SCALARS[start:start + 16]]
        runs.append("a" + " ".join(chars) + " " + "".join(chars) + "\n")
    sets.append((1, runs))
    sets.append((2, random_texts(4000)))
    if args.llama_cpp:
        text = open(args.llama_cpp, encoding="utf-8").read()
        sets.append((3, text.split("\n__ggml_vocab_test__\n")))
    if args.text:
        sets.append((4, [open(f, encoding="utf-8").read() for f in args.text]))
    return sets


def write_cases(args):
    tok = load(args.tokenizer)
    assert sys.byteorder == "little"
    with open(args.out + ".tmp", "wb") as out:
        for set_id, texts in cases(args):
            plain = tok.encode_batch(texts, add_special_tokens=False)
            framed = tok.encode_batch(texts, add_special_tokens=True) if set_id >= 3 else None
            decoded = tok.decode_batch([e.ids for e in plain], skip_special_tokens=False)
            chunk = []
            for i, (text, p, d) in enumerate(zip(texts, plain, decoded)):
                b = text.encode("utf-8")
                chunk.append(struct.pack("<BI", set_id, len(b)) + b)
                for ids in [p.ids] + ([framed[i].ids] if framed else []):
                    chunk.append(struct.pack("<I", len(ids)) + array.array("i", ids).tobytes())
                db = d.encode("utf-8")
                chunk.append(struct.pack("<I", len(db)) + db)
            out.write(b"".join(chunk))
    os.replace(args.out + ".tmp", args.out)


def gaps(args):
    import ctypes  # noqa: PLC0415
    import unicodedata  # noqa: PLC0415

    from tokenizers import Regex, normalizers, pre_tokenizers  # noqa: PLC0415

    assert unicodedata.unidata_version == "14.0.0", unicodedata.unidata_version
    lib = ctypes.CDLL("libutf8proc.so.2")
    lib.utf8proc_NFC.restype = ctypes.c_void_p
    lib.utf8proc_NFC.argtypes = [ctypes.c_char_p]
    libc = ctypes.CDLL(None)

    def utf8proc_nfc(text):
        p = lib.utf8proc_NFC(text.encode("utf-8"))
        out = ctypes.string_at(p).decode("utf-8")
        libc.free(ctypes.c_void_p(p))
        return out

    # PCRE2 10.42 with UCP: \p{L} / \p{N} by category (Unicode 14), \s = \p{Zs} + \h + \v.
    pcre_space = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u180e\u2028\u2029\u202f\u205f\u3000")
    pcre_space |= {chr(c) for c in range(0x2000, 0x200B)}
    classes = [(r"\p{L}", lambda c: unicodedata.category(c)[0] == "L"),
               (r"\p{N}", lambda c: unicodedata.category(c)[0] == "N"),
               (r"\s", lambda c: c in pcre_space or unicodedata.category(c) == "Zs")]
    nfc = normalizers.NFC()
    removers = [pre_tokenizers.Split(Regex(p), "removed") for p, _ in classes]
    found = []
    for cp in SCALARS:
        c = chr(cp)
        why = []
        if any(nfc.normalize_str(s) != utf8proc_nfc(s) for s in ("a" + c + "\u0301", c + c, "a" + c)):
            why.append("NFC")
        for remover, (pattern, member) in zip(removers, classes):
            if (remover.pre_tokenize_str(c) == []) != member(c):  # Oniguruma matched it
                why.append(pattern)
        if why:
            found.append((cp, " ".join(why)))
    ranges = []  # runs of consecutive code points with the same reasons
    for cp, why in found:
        if ranges and ranges[-1][1] == cp - 1 and ranges[-1][2] == why:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp, why])
    with open(args.out, "w") as f:
        f.write("# Code points whose Unicode data differ between PyPI tokenizers and meshtrain's\n")
        f.write("# libraries (hf_tokenizers_ref.py gaps; docs/tokenizers.md)\n")
        f.write("# FIRST LAST (hex) and what differs\n")
        f.write("".join(f"{a:04X} {b:04X} {why}\n" for a, b, why in ranges))
    print(f"gaps: {len(found)} code points in {len(ranges)} ranges -> {args.out}")


def bench(args):
    if args.threads:  # before tokenizers starts its thread pool
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    tok = load(args.tokenizer)
    texts = [open(f, encoding="utf-8").read() for f in args.files]
    spm = isinstance(tok, SentencePiece)
    if args.batch:
        if spm:
            run = lambda: tok.sp.encode(texts, num_threads=args.threads or -1)  # noqa: E731
        else:
            run = lambda: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    elif spm:
        run = lambda: [tok.sp.encode(t) for t in texts]  # noqa: E731
    else:
        run = lambda: [tok.encode(t, add_special_tokens=False).ids for t in texts]  # noqa: E731
    best, ids = float("inf"), []
    run()  # warm-up
    for _ in range(args.reps):
        t0 = time.perf_counter()
        ids = run()
        best = min(best, time.perf_counter() - t0)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    n = sum(len(i) for i in ids)
    name = "sentencepiece" if spm else "tokenizers"
    print(f"{name} {mb / best:.2f} MB/s {n / best:.0f} tokens/s ({n} tokens, best of {args.reps})")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cases")
    c.add_argument("--tokenizer", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--text", nargs="*")
    c.add_argument("--llama-cpp")
    b = sub.add_parser("bench")
    b.add_argument("--tokenizer", required=True)
    b.add_argument("--threads", type=int, default=0)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--batch", action="store_true")
    b.add_argument("files", nargs="+")
    g = sub.add_parser("gaps")
    g.add_argument("--out", required=True)
    args = ap.parse_args()
    {"cases": write_cases, "bench": bench, "gaps": gaps}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
