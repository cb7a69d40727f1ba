#!/usr/bin/env python3
"""No import circle between the Rust modules of src/: each file is a
module, and each path it names that starts with crate::, super:: or self::
is an edge to the deepest module that path reaches. A module and the
modules inside it are one family (a parent declares its children, a child
uses its parent's types): edges between them do not count. Comments are
left out. Exit status 1 on any circle, which it prints."""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graphs import circles  # noqa: E402  (.ci/graphs.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def modules(src):
    """{module path: file}: src/a/b.rs and src/a/b/mod.rs are crate::a::b."""
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                path = os.path.join(dirpath, f)
                parts = os.path.relpath(path, src)[:-3].split(os.sep)
                if parts[-1] in ("mod", "lib", "main"):
                    parts = parts[:-1]
                if parts and parts[0] == "bin":
                    continue  # binaries are crates of their own
                mods["::".join(["crate"] + parts)] = path
    return mods


def resolve(mods, here, path):
    parts = path.split("::")
    base = here.split("::")
    if parts[0] == "crate":
        at, parts = ["crate"], parts[1:]
    else:
        at = base[:]
        while parts and parts[0] == "super":
            at, parts = at[:-1], parts[1:]
        if parts and parts[0] == "self":
            parts = parts[1:]
    found = None
    for p in parts:
        at = at + [p]
        if "::".join(at) in mods:
            found = "::".join(at)
    return found


def family(a, b):
    return a == b or a.startswith(b + "::") or b.startswith(a + "::")


def graph(src):
    mods = modules(src)
    g = {}
    for m, path in mods.items():
        with open(path) as f:
            text = COMMENT.sub("", f.read())
        g[m] = {t for t in (resolve(mods, m, p) for p in PATH.findall(text))
                if t is not None and not family(m, t)}
    return g


def main():
    found = circles(graph(os.path.join(ROOT, "src")))
    for c in found:
        print("check_rust_modules: import circle: " + " -> ".join(c))
    print(f"check_rust_modules: {len(found)} circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
