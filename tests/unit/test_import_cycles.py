"""No import cycles among clusterctl's modules (issue 14), lazy imports included.

The graph is read from the source with `ast`, not by importing anything: an edge A -> B for every
`import clusterctl.x`, `from . import x`, `from .x import y` or `from ..x import y` in A, at module level
or inside a function (a lazy import runs too, later), with relative levels resolved against A's package.
`from P import n` is an edge to the submodule P.n when there is one, else to P. Importing P.n also runs
P's `__init__`, so it is an edge to P as well unless A is inside P (then P is already being imported).
Imports under `if TYPE_CHECKING:` never run and are left out. Names computed at run time
(cli.py's plugin table through importlib.import_module) are not imports this reader can see.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "clusterctl"

# Cycles still here, each as the set of modules of one strongly connected component (none today). An
# entry that no longer exists fails the test too, so this list cannot go stale.
KNOWN_CYCLES: set[frozenset[str]] = set()


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is named by its __init__.py)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node in `tree`, at any depth, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _existing(name: str, mods: dict[str, Path]) -> str | None:
    """`name`, or its nearest enclosing module that exists (`clusterctl.x.attr` -> `clusterctl.x`)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for the rules)."""
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_existing(a.name, mods) for a in node.names)
                continue
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in mods else _existing(base, mods))
        for target in targets - {None, mod}:
            graph[mod].add(target)
            parent = target.rpartition(".")[0]
            while parent and parent != PACKAGE:  # importing P.n runs P's __init__ first
                if not (mod == parent or mod.startswith(parent + ".")):
                    graph[mod].add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each as one cycle through all of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(comp: list[str], graph: dict[str, set[str]]) -> str:
    """One component as its modules and the import edges among them."""
    members = set(comp)
    edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members)]
    return "{" + ", ".join(comp) + "}: " + "; ".join(edges)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Lazy, relative, `from . import x`, absolute and package-parent edges are seen; TYPE_CHECKING is not."""
    files = {
        "__init__.py": "",
        "a.py": "from .b import thing\nfrom . import c\n",
        "b.py": "def f():\n    from .pkg.leaf import x\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\nelse:\n    import clusterctl.d\n",
        "d.py": "import os\nfrom clusterctl import a as _a\n",
        "pkg/__init__.py": "from .leaf import x\n",
        "pkg/leaf.py": "from .. import e\nfrom . import sib\n",
        "pkg/sib.py": "",
        "e.py": "",
    }
    for name, text in files.items():
        (tmp_path / PACKAGE / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {
        "clusterctl": set(),
        "clusterctl.a": {"clusterctl.b", "clusterctl.c"},
        "clusterctl.b": {"clusterctl.pkg.leaf", "clusterctl.pkg"},  # the package's __init__ runs too
        "clusterctl.c": {"clusterctl.d"},  # not clusterctl.a: that import is for type checkers only
        "clusterctl.d": {"clusterctl.a"},
        "clusterctl.pkg": {"clusterctl.pkg.leaf"},
        "clusterctl.pkg.leaf": {"clusterctl.e", "clusterctl.pkg.sib"},  # not its own package
        "clusterctl.pkg.sib": set(),
        "clusterctl.e": set(),
    }
    assert cycles(graph) == [["clusterctl.a", "clusterctl.c", "clusterctl.d"]]


def test_cycle_finder_reports_each_component():
    """Each strongly connected component once, sorted; a module that only reaches a cycle is not in it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """Every cycle among clusterctl's modules fails, listed; an allowlisted one that is gone fails too."""
    graph = import_graph()
    found = cycles(graph)
    unexpected = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    stale = sorted(sorted(c) for c in KNOWN_CYCLES if list(sorted(c)) not in found)
    message = []
    if unexpected:
        message.append("import cycles:\n  " + "\n  ".join(_describe(c, graph) for c in unexpected))
    if stale:
        message.append("KNOWN_CYCLES lists cycles that no longer exist (remove them): " + repr(stale))
    assert not message, "\n".join(message)
