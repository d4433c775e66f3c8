"""The package's shape: no import circles anywhere in infertrace/, and no import from a lower layer to a higher one
(docs/architecture.md). Every import counts, also one inside a function, since a deferred import is still a
dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "infertrace"

# Lowest first: a module may import from its own layer and the ones before it. A module belongs to the longest entry
# that is its name or a package above it ("infertrace" and "infertrace.load" name only their own __init__).
LAYERS: list[tuple[str, ...]] = [
    ("infertrace", "infertrace.console", "infertrace.auth", "infertrace.cache"),  # shared by every part
    ("infertrace.engine", "infertrace.modelgen"),
    ("infertrace.analyze",),
    ("infertrace.capture",),
    ("infertrace.server",),
    # load/, in the order a run goes; its shared vocabulary first
    ("infertrace.load", "infertrace.load.config", "infertrace.load.records", "infertrace.load.clock",
     "infertrace.load.stats"),
    ("infertrace.load.workloads",),
    ("infertrace.load.client",),
    ("infertrace.load.run",),
    ("infertrace.load.observe",),
    ("infertrace.load.results",),
    ("infertrace.load.benchmark", "infertrace.load.capacity", "infertrace.load.options"),
    ("infertrace.report",),  # renders what load/ and analyze/ produced
    ("infertrace.ablate", "infertrace.gate", "infertrace.bench"),
    ("infertrace.cli", "infertrace.__main__"),
]
EXACT_ONLY = {"infertrace", "infertrace.load"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (at any depth in the file)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_package = path.name == "__init__.py"
        package = mod if is_package else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                names = [name] + [f"{name}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            targets.update(n for n in names if n in files and n != mod)
        graph[mod] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(mod: str, layers: list[tuple[str, ...]] = LAYERS) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching entry, layer)
    for i, entries in enumerate(layers):
        for entry in entries:
            matches = mod == entry or (entry not in EXACT_ONLY and mod.startswith(entry + "."))
            if matches and (best is None or len(entry) > best[0]):
                best = (len(entry), i)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    out = []
    for mod, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target, layers) > layer_of(mod, layers):
                out.append(f"{mod} imports {target}")
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_no_import_circles(graph):
    assert cycles(graph) == []


def test_every_module_has_a_layer(graph):
    assert [m for m in graph if layer_of(m) is None] == []


def test_no_lower_layer_imports_a_higher_one(graph):
    assert upward_imports(graph) == []


def test_load_does_not_import_report(graph):
    assert not [(m, t) for m, ts in graph.items() if m.startswith("infertrace.load") for t in ts
                if t.startswith("infertrace.report")]


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    """The same checks over a small tree written here: a circle through a deferred import, and a lower package
    importing a higher one."""
    pkg = tmp_path / "infertrace"
    (pkg / "load").mkdir(parents=True)
    (pkg / "report").mkdir()
    for f in ("__init__.py", "load/__init__.py", "report/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "load" / "a.py").write_text("from infertrace.load import b\n")
    (pkg / "load" / "b.py").write_text("def f():\n    from infertrace.load.a import x\n")
    (pkg / "load" / "c.py").write_text("from infertrace.report.page import render\n")
    (pkg / "report" / "page.py").write_text("from . import helpers\nfrom infertrace.load.a import y\n")
    (pkg / "report" / "helpers.py").write_text("")
    g = import_graph(pkg)
    assert g["infertrace.report.page"] == {"infertrace.report", "infertrace.report.helpers", "infertrace.load.a"}
    assert cycles(g) == [["infertrace.load.a", "infertrace.load.b"]]
    layers = [("infertrace", "infertrace.load"), ("infertrace.load.a", "infertrace.load.b", "infertrace.load.c"),
              ("infertrace.report",)]
    assert layer_of("infertrace.load.a", layers) == 1 and layer_of("infertrace.report.page", layers) == 2
    assert upward_imports(g, layers) == ["infertrace.load.c imports infertrace.report.page"]
