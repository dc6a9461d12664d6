#!/usr/bin/env python3
"""Writes COUNT random token ids below VOCAB (seeded) as an llm.c token file (throughput and
interop tests that need tokens of a given vocabulary, not text).

    python3 tests/support/random_tokens.py OUT COUNT VOCAB [SEED]
"""
import random
import struct
import sys

out, n, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
with open(out, "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *(random.randrange(vocab) for _ in range(n))))
