"""Unpacks the tokenizer fixtures into OUT/<name>/ (tokenizer.json and
tokenizer_config.json): the xz-compressed conversions, and each variant's
pipeline set on its base vocabulary (make_fixtures.py, README.md); and the
SentencePiece models as OUT/<name>/tokenizer.model.
Standard library only. Usage: unpack.py OUT"""
import argparse
import glob
import json
import lzma
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    with lzma.open(os.path.join(HERE, f"{name}.tokenizer.json.xz"), "rt") as f:
        return json.load(f)


def save(out, name, tokenizer):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, "tokenizer.json.tmp")
    with open(tmp, "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    os.replace(tmp, os.path.join(d, "tokenizer.json"))
    shutil.copy(os.path.join(HERE, f"{name}.tokenizer_config.json"),
                os.path.join(d, "tokenizer_config.json"))


def main(out):
    names = []
    for path in sorted(glob.glob(os.path.join(HERE, "*.tokenizer.json.xz"))):
        name = os.path.basename(path)[: -len(".tokenizer.json.xz")]
        save(out, name, load(name))
        names.append(name)
    for path in sorted(glob.glob(os.path.join(HERE, "*.variant.json"))):
        name = os.path.basename(path)[: -len(".variant.json")]
        variant = json.load(open(path))
        tokenizer = load(variant["base"])
        for key, value in variant["set"].items():
            node = tokenizer
            *parents, leaf = key.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = value
        save(out, name, tokenizer)
        names.append(name)
    for path in sorted(glob.glob(os.path.join(HERE, "*.tokenizer.model"))):
        name = os.path.basename(path)[: -len(".tokenizer.model")]
        os.makedirs(os.path.join(out, name), exist_ok=True)
        shutil.copy(path, os.path.join(out, name, "tokenizer.model"))
        names.append(name)
    print("unpack: " + " ".join(names) + " -> " + out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the directory to unpack into")
    main(parser.parse_args().out)
