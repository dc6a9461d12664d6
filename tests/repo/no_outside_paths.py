#!/usr/bin/env python3
"""Fails if a tracked file refers to a path outside the repository.

  no_outside_paths.py REPO_ROOT

Everything a test, script, benchmark or doc example reads is in the repository or made by the
project's own scripts (docs/setup.md). Checked: the tracked files under src, tests, scripts,
bench, docs, configs and .ci, every CMakeLists.txt and *.cmake, and README.md. Flagged:
  - a `../` path that resolves above the repository root, taken from the file's folder when it
    stands alone ("../x", (../x), =../x) or follows a this-folder prefix ($(dirname "$0")/,
    $here/, ${CMAKE_CURRENT_SOURCE_DIR}/, ${CMAKE_CURRENT_LIST_DIR}/), and from the root when it
    follows a root prefix (${PROJECT_SOURCE_DIR}/, ${CMAKE_SOURCE_DIR}/, $root/, $ROOT_DIR/);
  - the project's shared folder by name, however it is reached (string joins in C++ or Python).
Standard library only: run by Debian's /usr/bin/python3 before anything is installed.
"""
import os
import re
import subprocess
import sys

SCOPE_DIRS = ("src/", "tests/", "scripts/", "bench/", "docs/", "configs/", ".ci/")
TEXT_LIMIT = 4 << 20

FOLDER_PREFIX = (r'\$\(dirname "\$0"\)/|\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/|\$\{?here\}?/'
                 r'|\$\{CMAKE_CURRENT_SOURCE_DIR\}/|\$\{CMAKE_CURRENT_LIST_DIR\}/')
ROOT_PREFIX = r'\$\{PROJECT_SOURCE_DIR\}/|\$\{CMAKE_SOURCE_DIR\}/|\$\{?root\}?/|\$\{?ROOT_DIR\}?/'
# After a prefix: "..", "../..", "../x"; standing alone: "../" at least (prose has "...").
REFERENCE = re.compile(
    rf'(?:(?P<root>{ROOT_PREFIX})|(?P<folder>{FOLDER_PREFIX}))(?P<prefixed>\.\.(?:/[\w.+@-]*)*)'
    r'|(?<![\w.$}/\\-])(?P<alone>(?:\.\./)+[\w.+@/-]*)')
# The shared folder beside the checkout, by any spelling the code has used (the character
# classes keep this file from matching itself).
SHARED = re.compile(r'\.\./shared\b|/work/share[d]\b|MESHTRAIN_SHARE[D]_DIR|"\.\.",\s*"share[d]"')


def tracked_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True,
                             capture_output=True).stdout.decode()
        return [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):  # a tarball, not a clone: walk it
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not (d.startswith("build") or d in (".git", "data", "runs"))]
            files += [os.path.relpath(os.path.join(folder, n), root) for n in names]
        return files


def in_scope(path):
    name = os.path.basename(path)
    return (path.startswith(SCOPE_DIRS) or path == "README.md" or name == "CMakeLists.txt"
            or name.endswith(".cmake"))


def findings(root, rel):
    with open(os.path.join(root, rel), "rb") as f:
        data = f.read(TEXT_LIMIT)
    if b"\0" in data:
        return []  # binary (a model, a fixture)
    text = data.decode("utf-8", errors="replace")
    folder = os.path.dirname(os.path.join(root, rel))
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in SHARED.finditer(line):
            out.append(f"{rel}:{lineno}: '{m.group(0)}' names the shared folder outside the repository")
        for m in REFERENCE.finditer(line):
            base = root if m.group("root") else folder
            target = os.path.normpath(os.path.join(base, m.group("prefixed") or m.group("alone")))
            if os.path.commonpath([root, target]) != root:
                out.append(f"{rel}:{lineno}: '{m.group(0)}' leaves the repository (resolves to {target})")
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: no_outside_paths.py REPO_ROOT")
    root = os.path.realpath(sys.argv[1])
    problems = []
    for rel in sorted(tracked_files(root)):
        if in_scope(rel) and os.path.isfile(os.path.join(root, rel)):
            problems += findings(root, rel)
    for p in problems:
        print(p)
    if problems:
        print(f"no_outside_paths: {len(problems)} reference(s) to paths outside {root}")
        return 1
    print(f"no_outside_paths: no tracked file refers outside {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
