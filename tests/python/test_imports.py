"""The package's modules and their imports, from the source tree.

No import circles and no function defined in two modules: the check is
.ci/check_python_imports.py (CI runs it before the long sections); here it
runs on the package and on small packages made for the purpose, so a
change to its rules shows what it catches. Every `from rdma_device.x import
y` in the tree names something that exists. The command lines the README
and docs name start (their --help)."""

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG_DIR = os.path.join(REPO, "python", "rdma_device")


def _load_check():
    spec = importlib.util.spec_from_file_location("check_python_imports",
                                                  os.path.join(REPO, ".ci", "check_python_imports.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


check = _load_check()


def _package(tmp_path, files):
    """A package "pkg" under tmp_path from {relative path: source}."""
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return check.modules(str(root), "pkg")


def test_the_graph_sees_module_and_function_level_imports():
    graph = check.graph(check.modules())
    assert "rdma_device._loader" in graph["rdma_device"]  # module level
    assert "rdma_device.doctor.cli" in graph["rdma_device.__main__"]  # under an if
    assert "rdma_device.bench.mwms" in graph["rdma_device.bench.cli"]  # inside a function
    assert "rdma_device.bench.report_tables" in graph["rdma_device.bench.report"]  # from a package import a module
    assert check.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_circles_and_no_function_defined_twice_in_the_package():
    mods = check.modules()
    assert {"rdma_device.bench.cli", "rdma_device.doctor.host"} <= set(mods)
    assert not any("lib" in m.split(".") for m in mods)
    found = check.circles(check.graph(mods))
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)
    shared = check.shared_functions(mods)
    assert not shared, f"functions defined in more than one module: {shared}"


def test_a_package_and_its_submodules(tmp_path):
    """The package's own __init__ is no edge of its submodules; an explicit
    import of it is, absolute or relative."""
    mods = _package(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from pkg.sub import a\nX = 1\n",
        "sub/a.py": "def f():\n    from pkg.sub.b import g\n",
        "sub/b.py": "import pkg.c\n",
        "c.py": "",
    })
    g = check.graph(mods)
    assert g == {"pkg": set(), "pkg.sub": {"pkg.sub.a"}, "pkg.sub.a": {"pkg.sub.b"},
                 "pkg.sub.b": {"pkg.c"}, "pkg.c": set()}, g
    assert check.circles(g) == []
    # The submodule takes a name back from the package whose __init__
    # imports it: a circle (relative import).
    (tmp_path / "pkg" / "sub" / "b.py").write_text("from . import X\n")
    (tmp_path / "pkg" / "sub" / "a.py").write_text("from .b import g\n")
    assert check.circles(check.graph(mods)) == [["pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub"]]


def test_a_function_defined_in_two_modules(tmp_path):
    mods = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "def size(n):\n    return n\n\ndef main():\n    pass\n",
        "b/__init__.py": "",
        "b/c.py": "if True:\n    def size(n):\n        return n\n\ndef main():\n    pass\n\nclass K:\n"
                  "    def size(self):\n        pass\n",
    })
    assert check.shared_functions(mods) == {"size": ["pkg.a", "pkg.b.c"]}


def _top_level_names(path):
    """Names a module defines at its top level: functions, classes,
    assignments and imports (including those under a top-level if/try)."""
    names = set()
    for node in check.top_level_statements(path):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _repo_python_files():
    for top in ("python", "examples", "tests", "bench", ".ci"):
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "lib", "build")]
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def test_every_name_imported_from_the_package_exists():
    """`from rdma_device.x import y` (x a module or a subpackage, e.g.
    rdma_device.bench.soak) anywhere in the tree (the package, the
    examples, the tests) names something x defines or a module of x: a
    helper moved to another module breaks its callers here, not in a
    user's run. `import rdma_device.x` names a module that exists."""
    mods = check.modules()
    defined = {}
    missing = []
    for path in _repo_python_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        where = f"{os.path.relpath(path, REPO)}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("rdma_device.") and a.name not in mods:
                        missing.append(f"{where}:{node.lineno}: no module {a.name}")
                continue
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] != "rdma_device":
                continue
            if node.module not in mods:
                missing.append(f"{where}:{node.lineno}: no module {node.module}")
                continue
            if node.module not in defined:
                defined[node.module] = _top_level_names(mods[node.module])
            for a in node.names:
                if a.name == "*" or f"{node.module}.{a.name}" in mods:
                    continue
                if a.name not in defined[node.module]:
                    missing.append(f"{where}:{node.lineno}: {node.module} has no {a.name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("argv", [
    ["rdma_device.bench"],
    *[["rdma_device.bench", cmd] for cmd in ("transfer", "train", "suite", "allreduce", "soak", "trace", "py",
                                                 "report")],
    ["rdma_device.doctor"],
    ["rdma_device", "doctor"],
    ["rdma_device", "config"],
])
def test_the_command_lines_start(argv):
    """`python -m ... --help` of each command the README and docs name:
    exit status 0 and its usage line."""
    p = subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("usage: "), p.stdout[:500]
