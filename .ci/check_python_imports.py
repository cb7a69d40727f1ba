#!/usr/bin/env python3
"""No import circle between the modules of python/rdma_device, and no
top-level function defined in two of them.

Each module is parsed, not imported. Every import of another module of the
package is an edge, at module level or inside a function alike (an import
deferred into a function hides a circle, it does not break it):
``import rdma_device.a.b`` and ``from rdma_device.a import b`` (b a module)
name the module rdma_device.a.b; ``from rdma_device.a import name`` (name
not a module) names the package rdma_device.a, that is its __init__.py;
relative imports resolve the same way.

A package and its submodules: importing rdma_device.a.b first runs the
__init__.py of rdma_device and of rdma_device.a, but that implicit step is
not an edge (it completes before the submodule runs unless the __init__
itself imports the submodule); explicit imports are. So a package whose
__init__.py imports a submodule that imports names back from the package is
a circle, and a submodule that only lives inside its package is not.

A function name defined at the top level of two modules is one helper
written twice (or two helpers that a reader cannot tell apart): give it one
home, or tell them apart by name. ALLOWED lists the names that are the
same on purpose.

Exit status 1 on any circle (each printed as a -> b -> a) or shared name."""

import ast
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graphs import circles  # noqa: E402  (.ci/graphs.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "rdma_device"
PKG_DIR = os.path.join(ROOT, "python", PKG)

# Function names that several modules define on purpose, and why.
ALLOWED = {
    # The entry point of each command line (bench.cli, doctor.cli).
    "main",
    # How a bench subcommand module adds its options to the bench's parser
    # (bench.cli calls each module's add_parser).
    "add_parser",
}


def modules(pkg_dir=PKG_DIR, pkg=PKG):
    """{dotted module name: path}; a package is named by its __init__.py.
    Folders without __init__.py (lib/) are not packages."""
    mods = {}
    for dirpath, dirs, files in os.walk(pkg_dir):
        dirs[:] = sorted(d for d in dirs if os.path.exists(os.path.join(dirpath, d, "__init__.py")))
        rel = os.path.relpath(dirpath, pkg_dir)
        parts = [pkg] + ([] if rel == "." else rel.split(os.sep))
        for f in sorted(files):
            if f.endswith(".py"):
                stem = f[:-3]
                mods[".".join(parts if stem == "__init__" else parts + [stem])] = os.path.join(dirpath, f)
    return mods


def _deepest(mods, dotted):
    """The deepest module of the package that ``dotted`` reaches, or None."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in mods:
            return name
    return None


def _base(mod, path, node):
    """The module a ``from ... import`` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    package = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports(mods, mod, path):
    """The modules of the package that ``mod`` imports (not itself)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges.update(t for t in (_deepest(mods, a.name) for a in node.names) if t)
        elif isinstance(node, ast.ImportFrom):
            base = _base(mod, path, node)
            target = _deepest(mods, base)
            if target is None:
                continue
            if target != base:  # from rdma_device.a.b.name import x: b itself
                edges.add(target)
                continue
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            edges.update(subs)
            if len(subs) < len(node.names):  # a name the package's __init__ defines
                edges.add(base)
    edges.discard(mod)
    return edges


def graph(mods):
    return {m: imports(mods, m, p) for m, p in mods.items()}


def top_level_statements(path):
    """The statements a module runs at its top level, those under a
    top-level if/try included (their branches flattened in order)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)

    def walk(body):
        for node in body:
            if isinstance(node, ast.If):
                yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try):
                yield from walk(node.body)
                for h in node.handlers:
                    yield from walk(h.body)
                yield from walk(node.orelse)
                yield from walk(node.finalbody)
            else:
                yield node

    return list(walk(tree.body))


def top_level_functions(path):
    """Names of the functions a module defines at its top level (under a
    top-level if/try too)."""
    return {n.name for n in top_level_statements(path)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def shared_functions(mods, allowed=ALLOWED):
    """{function name: [modules]} for each name defined in two or more."""
    where = {}
    for m, path in sorted(mods.items()):
        for name in top_level_functions(path):
            where.setdefault(name, []).append(m)
    return {n: ms for n, ms in sorted(where.items()) if len(ms) > 1 and n not in allowed}


def main():
    mods = modules()
    found = circles(graph(mods))
    for c in found:
        print("check_python_imports: import circle: " + " -> ".join(c))
    shared = shared_functions(mods)
    for name, ms in shared.items():
        print(f"check_python_imports: {name}() is defined in {len(ms)} modules: {', '.join(ms)}")
    print(f"check_python_imports: {len(mods)} modules, {len(found)} circle(s), "
          f"{len(shared)} function name(s) defined twice")
    return 1 if found or shared else 0


if __name__ == "__main__":
    sys.exit(main())
