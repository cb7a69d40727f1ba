"""No import circles inside the package: every module of
python/rdma_device is parsed (not imported) and each import of another
module of the package is an edge, at module level or inside a function
alike (an import deferred into a function hides a circle, it does not
break it)."""

import ast
import os

PKG = "rdma_device"
PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "python", PKG)


def _modules():
    """{module name: path}; the package itself is its __init__.py."""
    mods = {}
    for name in sorted(os.listdir(PKG_DIR)):
        if name.endswith(".py"):
            stem = name[:-3]
            mods[PKG if stem == "__init__" else f"{PKG}.{stem}"] = os.path.join(PKG_DIR, name)
    return mods


def import_graph():
    """{module: {modules of the package it imports}}. `from rdma_device
    import x` names module x if there is one, else the package; `from
    rdma_device.x import y` names x (importing x also runs the package's
    __init__, but Python allows that one while the package is importing)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([PKG] + ([base] if base else []))
                if base not in mods:
                    continue
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                edges.update(subs)
                if len(subs) < len(node.names):
                    edges.add(base)
        edges.discard(mod)
        graph[mod] = edges
    return graph


def find_cycle(graph):
    """One cycle as [a, b, ..., a], or None."""
    state = {}
    stack = []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "rdma_device._loader" in graph["rdma_device"]  # module level
    assert "rdma_device.doctor" in graph["rdma_device.__main__"]  # under an if
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circles_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _top_level_names(path):
    """Names a module defines at its top level: functions, classes,
    assignments and imports (including those under a top-level if/try)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()

    def collect(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If):
                collect(node.body)
                collect(node.orelse)
            elif isinstance(node, ast.Try):
                collect(node.body)
                for h in node.handlers:
                    collect(h.body)
                collect(node.orelse)
                collect(node.finalbody)

    collect(tree.body)
    return names


def _repo_python_files():
    repo = os.path.dirname(os.path.dirname(PKG_DIR))
    for top in ("python", "examples", "tests", "bench", ".ci"):
        for root, dirs, files in os.walk(os.path.join(repo, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "lib", "build")]
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def test_every_name_imported_from_the_package_exists():
    """`from rdma_device.x import y` anywhere in the tree (the package, the
    examples, the tests) names something x defines: a helper moved to
    another module breaks its callers here, not in a user's run."""
    mods = _modules()
    defined = {}
    missing = []
    for path in _repo_python_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in mods:
                continue
            if node.module not in defined:
                defined[node.module] = _top_level_names(mods[node.module])
            for a in node.names:
                if a.name == "*" or f"{node.module}.{a.name}" in mods:
                    continue
                if a.name not in defined[node.module]:
                    missing.append(f"{os.path.relpath(path, os.path.dirname(os.path.dirname(PKG_DIR)))}:"
                                   f"{node.lineno}: {node.module} has no {a.name}")
    assert not missing, "\n".join(missing)
