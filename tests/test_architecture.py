"""The layering rules, checked on the source (pure Python, no JAX or torch needed).

* ``pallas_kernels`` imports nothing from ``hicache_jax``: kernels never depend on the
  manager that drives them.
* The cache package (``hicache_jax/cache``, the tree and its residency, locks, transfers and
  policies) is the only place that reads private attributes (``_name``) of the cache or of
  its nodes: every other module (the L3 controller, the engine, benchmarks, npu_bridge, the
  tests) goes through public attributes, the L3 surface or ``debug_view()``.
* Library modules (``hicache_jax``, ``npu_bridge``, ``pallas_kernels``, ``benchmarks``; not the
  test files beside the kernels) read no private attribute of an object other than
  ``self``/``cls`` unless a class of the same module defines that attribute (a module's own
  helper classes are its business), and import no private name from another module (a
  package's private submodule, ``from . import _lazy``, is its own package's business).
* No import circles among the modules of ``hicache_jax``, ``npu_bridge`` and ``pallas_kernels``:
  every import counts, also those inside functions and under ``TYPE_CHECKING`` (a circle closed
  only for the type checker still ties the modules into one), and a package's ``__init__`` is a
  module like the others.

Each rule's checker is itself tested on a snippet that breaks it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE_PKG = ROOT / "hicache_jax" / "cache"
LIBRARY = ("hicache_jax", "npu_bridge", "pallas_kernels", "benchmarks")
# Private names of third-party modules that a library module must touch, with the reason.
ALLOWED_FOREIGN = {
    # benchmarks/upstream_tree_replay.py: upstream sglang's host pool pins memory with CUDA at
    # import; the CPU baseline replaces that hook (it is upstream's module, not ours).
    "_cuda_host_register",
    # os._exit: the standard library's documented immediate exit (a child process ending
    # without running the parent's cleanup), private in name only.
    "_exit",
    # threading._register_atexit: the interpreter-shutdown hook concurrent.futures uses to stop
    # its workers; hicache_jax/l3/exit_flush.py flushes L3 writes through it, before that stop
    # (a plain atexit hook runs after it, when no thread pool takes work any more).
    "_register_atexit",
}


def _py_files(*tops: str) -> list[Path]:
    out = []
    for top in tops:
        out.extend(p for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)
    return sorted(out)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module's classes define: ``self._x = ...``, ``__slots__`` entries,
    class-level assignments and methods."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                names.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                if _private(node.attr):
                    names.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and _private(t.id):
                        names.add(t.id)
                    if isinstance(t, ast.Name) and t.id == "__slots__" and node.value is not None:
                        for elt in getattr(node.value, "elts", ()):
                            if isinstance(elt, ast.Constant) and isinstance(elt.value, str) and _private(elt.value):
                                names.add(elt.value)
    return names


def _foreign_private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``x._name`` where ``x`` is not ``self`` / ``cls`` / ``super()`` (line, source)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            out.append((node.lineno, node.attr, ast.unparse(node)))
    return out


def _cache_private_names() -> set[str]:
    names = set()
    for path in CACHE_PKG.rglob("*.py"):
        names |= _defined_privates(ast.parse(path.read_text()))
    return names


def cache_private_violations(source: str, cache_names: set[str]) -> list[str]:
    """Reads of the cache's (or its nodes') private attributes by a module outside the cache
    package; a name the module's own classes define too is that module's business."""
    tree = ast.parse(source)
    own = _defined_privates(tree)
    return [
        f"{line}: {text}"
        for line, attr, text in sorted(_foreign_private_reads(tree))
        if attr in cache_names and attr not in own
    ]


def library_violations(source: str) -> list[str]:
    tree = ast.parse(source)
    own = _defined_privates(tree)
    return [
        f"{line}: {text}"
        for line, attr, text in sorted(_foreign_private_reads(tree))
        if attr not in own and attr not in ALLOWED_FOREIGN
    ]


# Private names of third-party modules that a library module must import, with the reason.
ALLOWED_FOREIGN_IMPORTS = {
    # hicache_jax/storage/integrity.py: google_crc32c's C extension module, whose
    # ``crc32c_extend`` it calls through ctypes with the GIL released (the package's own
    # wrapper keeps the GIL for numpy buffers).
    "_crc32c",
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in the module ``name`` (file ``path``) reads."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_import_violations(source: str, name: str, path: Path, modules: set[str]) -> list[str]:
    """``from m import _x`` where ``_x`` is a private name defined in another module (not a
    private submodule of a package of ours, not an allowed third-party name)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or (node.module or "") == "__future__":
            continue
        mod = _imported(name, path, node)
        for a in node.names:
            if not _private(a.name) or f"{mod}.{a.name}" in modules:
                continue
            if mod.split(".")[0] not in {m.split(".")[0] for m in modules} and a.name in ALLOWED_FOREIGN_IMPORTS:
                continue
            out.append(f"{node.lineno}: from {mod} import {a.name}")
    return out


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` it imports (every import statement anywhere in it);
    ``from pkg import name`` reads ``pkg.name`` where that is a module, else ``pkg``."""
    names = {_module_name(p, root): p for p in files}
    graph: dict[str, set[str]] = {m: set() for m in names}
    for m, p in names.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _imported(m, p, node)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in names else mod for a in node.names]
            else:
                continue
            for t in targets:
                while t not in names and "." in t:  # a name inside a module: the module
                    t = t.rsplit(".", 1)[0]
                if t in names and t != m:
                    graph[m].add(t)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def kernel_import_violations(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "hicache_jax"]
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "hicache_jax"
        ):
            out.append(f"{node.lineno}: from {node.module} import ...")
    return out


# ---------------------------------------------------------------------------------- the rules
def test_pallas_kernels_import_nothing_from_hicache_jax():
    bad = {
        str(p.relative_to(ROOT)): v
        for p in _py_files("pallas_kernels")
        if (v := kernel_import_violations(p.read_text()))
    }
    assert not bad, f"pallas_kernels must not depend on hicache_jax: {bad}"


def test_nothing_outside_the_cache_package_reads_cache_privates():
    names = _cache_private_names()
    assert {"_ledger", "_res", "_tree", "_lock_path"} <= names  # the scan sees the cache's privates
    bad = {}
    for p in _py_files(*LIBRARY, "tests"):
        if CACHE_PKG in p.parents:
            continue
        v = cache_private_violations(p.read_text(), names)
        if v:
            bad[str(p.relative_to(ROOT))] = v
    assert not bad, f"private attributes of the cache or its nodes read outside hicache_jax/cache: {bad}"


def test_library_modules_read_no_other_modules_privates():
    bad = {}
    for p in _py_files(*LIBRARY):
        if p.name.startswith("test_") or p.name == "conftest.py":  # tests beside the kernels: the rule above
            continue
        v = library_violations(p.read_text())
        if v:
            bad[str(p.relative_to(ROOT))] = v
    assert not bad, f"library modules reading another module's private attributes: {bad}"


def test_library_modules_import_no_other_modules_private_names():
    files = [p for p in _py_files(*LIBRARY) if not (p.name.startswith("test_") or p.name == "conftest.py")]
    modules = {_module_name(p) for p in files}
    bad = {}
    for p in files:
        v = private_import_violations(p.read_text(), _module_name(p), p, modules)
        if v:
            bad[str(p.relative_to(ROOT))] = v
    assert not bad, f"library modules importing another module's private names: {bad}"


def test_no_import_circles_in_the_packages():
    graph = import_graph(_py_files("hicache_jax", "npu_bridge", "pallas_kernels"))
    # the graph sees the cache's imports: the package imports the facade, the facade its metrics
    assert "hicache_jax.cache.hiradix_cache" in graph["hicache_jax.cache"]
    assert "hicache_jax.cache.metrics" in graph["hicache_jax.cache.hiradix_cache"]
    circles = import_circles(graph)
    assert not circles, f"import circles (every import counts, TYPE_CHECKING ones too): {circles}"


# ---------------------------------------------------------------------------------- the checkers
def test_checkers_see_what_they_claim(tmp_path):
    names = _cache_private_names()
    # An L3-controller-like module reaching into the cache and into a node.
    src = "def f(cache, node):\n    cache._ledger.writes\n    node.owner._tree\n    return self._x\n"
    assert [v.split(": ")[1] for v in cache_private_violations(src, names)] == ["cache._ledger", "node.owner._tree"]
    # A module's own class may use its own private attributes on other instances.
    own = "class Op:\n    def __init__(self):\n        self._cond = 1\n\ndef g(op):\n    return op._cond\n"
    assert library_violations(own) == []
    assert library_violations("def g(op):\n    return op._cond\n") == ["2: op._cond"]
    assert library_violations("def g(m):\n    m._cuda_host_register = None\n") == []
    assert kernel_import_violations("from hicache_jax.allocator import check_page_ids\n") == [
        "1: from hicache_jax.allocator import ..."
    ]
    assert kernel_import_violations("import hicache_jax.cache as c\nimport numpy\n") == ["1: import hicache_jax.cache"]
    assert kernel_import_violations("from .common import x\nimport jax\n") == []
    # private names: another module's is refused, a sibling private module and an allowed
    # third-party name are not
    mods = {"pkg", "pkg.a", "pkg._lazy", "pkg.b"}
    here = ROOT / "pkg" / "b.py"
    assert private_import_violations("from .a import _helper, public\n", "pkg.b", here, mods) == [
        "1: from pkg.a import _helper"
    ]
    assert (
        private_import_violations("from . import _lazy\nfrom google_crc32c import _crc32c\n", "pkg.b", here, mods) == []
    )
    assert private_import_violations("from numpy import _secret\n", "pkg.b", here, mods) == [
        "1: from numpy import _secret"
    ]
    # circles: a type-only import closes one as well as a plain one; a chain is none
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    tmp = tmp_path
    (tmp / "p").mkdir()
    (tmp / "p" / "__init__.py").write_text("from .x import X\n")
    (tmp / "p" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .y import Y\nX = 1\n"
    )
    (tmp / "p" / "y.py").write_text("def f():\n    from .x import X\n    return X\n")
    g = import_graph(sorted((tmp / "p").glob("*.py")), root=tmp)
    assert import_circles(g) == [["p.x", "p.y"]]


@pytest.mark.parametrize("module", ["hicache_jax.cache", "hicache_jax.l3"])
def test_the_cache_never_imports_the_l3_driver(module):
    """Dependencies point one way: l3 -> cache, never cache -> l3 (except the lazy
    compatibility names in ``hicache_jax.cache.__init__``)."""
    for p in CACHE_PKG.rglob("*.py"):
        if p.name == "__init__.py" and p.parent == CACHE_PKG:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                assert not (node.level >= 2 and mod.startswith("l3")) and not mod.startswith("hicache_jax.l3"), p
