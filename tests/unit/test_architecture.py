"""The rules docs/architecture.md states, each held here: the layers import one way, no cycles once the CLI's
plugin table (imported by name at run time) is counted, and no module over ~600 lines without a written
reason at its top."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_import_cycles import ROOT, _describe, cycles, import_graph, modules  # noqa: E402

from clusterctl import cli  # noqa: E402

MAX_LINES = 600
WHY = "Why one module"  # the paragraph a module over MAX_LINES starts its docstring's reason with

# (importer prefix, imported prefixes it must never reach): the layers of docs/architecture.md §1, one way.
# A prefix matches a module and its submodules.
FORBIDDEN = [
    ("clusterctl.spec", ("clusterctl.backends", "clusterctl.ops", "clusterctl.remote", "clusterctl.transport",
                         "clusterctl.sshconn", "clusterctl.sshkeys", "clusterctl.cli", "clusterctl.commands")),
    ("clusterctl.plan", ("clusterctl.backends", "clusterctl.ops", "clusterctl.remote", "clusterctl.transport",
                         "clusterctl.spec", "clusterctl.commands")),
    ("clusterctl.ops", ("clusterctl.backends", "clusterctl.cli", "clusterctl.commands")),
    ("clusterctl.remote", ("clusterctl.ops", "clusterctl.backends", "clusterctl.spec", "clusterctl.cli",
                           "clusterctl.commands")),
    ("clusterctl.transport", ("clusterctl.ops", "clusterctl.backends", "clusterctl.cli", "clusterctl.remote",
                              "clusterctl.spec", "clusterctl.plan", "clusterctl.commands")),
    ("clusterctl.backends", ("clusterctl.cli", "clusterctl.commands")),
    ("clusterctl.host", ("clusterctl.spec", "clusterctl.plan", "clusterctl.ops", "clusterctl.backends",
                         "clusterctl.remote", "clusterctl.transport", "clusterctl.cli", "clusterctl.commands")),
]


# Downward imports the table above would otherwise catch: `Host` lives at the bottom, in the transport layer,
# and the spec and the plan build it (docs/architecture.md §4); importing it runs the package's __init__.
ALLOWED = {"clusterctl.transport.host", "clusterctl.transport"}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_layers_import_one_way():
    graph = import_graph()
    bad = []
    for importer, banned in FORBIDDEN:
        for mod, targets in graph.items():
            if not _under(mod, importer):
                continue
            for target in sorted(targets - ALLOWED):
                if any(_under(target, b) for b in banned):
                    bad.append(f"{mod} -> {target}")
    assert not bad, "imports against the layers (docs/architecture.md §1):\n  " + "\n  ".join(bad)


def test_the_rule_table_would_catch_a_wrong_way_import():
    """The check above is not vacuous: an ops module importing the backends is caught."""
    graph = {"clusterctl.ops.job": {"clusterctl.backends.ssh"}, "clusterctl.backends.ssh": {"clusterctl.ops"}}
    caught = [f"{m} -> {t}" for imp, banned in FORBIDDEN for m, ts in graph.items() if _under(m, imp)
              for t in ts if any(_under(t, b) for b in banned)]
    assert caught == ["clusterctl.ops.job -> clusterctl.backends.ssh"]


def test_no_cycles_with_the_clis_plugins_counted():
    """cli.py loads its plugins by name (importlib): counted as imports, the graph still has no cycle."""
    graph = import_graph()
    assert set(cli._PLUGINS) <= set(graph), set(cli._PLUGINS) - set(graph)
    graph["clusterctl.cli"] |= set(cli._PLUGINS)
    found = cycles(graph)
    assert not found, "\n".join(_describe(c, graph) for c in found)


def test_a_module_over_600_lines_says_why_at_its_top():
    long, unexplained = [], []
    for name, path in modules().items():
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines <= MAX_LINES:
            continue
        long.append(name)
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if WHY not in doc:
            unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not unexplained, f"over {MAX_LINES} lines with no '{WHY} ...' paragraph at the top: {unexplained}"
    assert len(long) < 8, long  # a few, each with its reason; not a habit


def test_no_two_test_modules_share_a_name():
    """pytest (rootdir-relative imports, no __init__.py) refuses to collect two test modules of one basename: the
    whole run would stop at collection, found only when every directory is collected together."""
    seen: dict[str, list[str]] = {}
    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(root)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
