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
    # shared by every part
    ("infertrace", "infertrace.console", "infertrace.auth", "infertrace.cache", "infertrace.config_fields",
     "infertrace.input_files",
     "infertrace.exits", "infertrace.output"),
    ("infertrace.engine", "infertrace.modelgen"),
    ("infertrace.analyze",),
    ("infertrace.capture",),
    # server/: settings shared by both rooms, then the HTTP front end, then the engine link, then the command
    ("infertrace.server", "infertrace.server.settings"),
    ("infertrace.server.frontend",),
    ("infertrace.server.engine_link",),
    ("infertrace.server.command",),
    # load/, in the order a run goes; its shared vocabulary first
    ("infertrace.load", "infertrace.load.config", "infertrace.load.records", "infertrace.load.clock",
     "infertrace.load.stats", "infertrace.load.server_log", "infertrace.load.server_metrics"),
    ("infertrace.load.workloads",),
    ("infertrace.load.client",),
    ("infertrace.load.run",),
    ("infertrace.load.observe",),
    ("infertrace.load.results",),
    ("infertrace.load.benchmark", "infertrace.load.capacity", "infertrace.load.options"),
    ("infertrace.load.report",),  # the HTML run report, drawn from what load/ and analyze/ produced
    ("infertrace.load.command",),  # `infertrace bench`: the one module that joins the run and its report
    ("infertrace.ablate", "infertrace.gate"),
    ("infertrace.cli", "infertrace.__main__"),
]
EXACT_ONLY = {"infertrace", "infertrace.load", "infertrace.server"}


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


def test_only_the_bench_command_imports_the_report(graph):
    assert not [(m, t) for m, ts in graph.items() if not m.startswith(("infertrace.load.report", "infertrace.load.command"))
                for t in ts if t.startswith("infertrace.load.report")]


# What moves bytes over a network: a stage that only computes imports none of it.
NETWORK_MODULES = ("aiohttp", "socket", "http", "httpx", "requests", "urllib", "urllib3", "ssl", "asyncio",
                   "ray", "infertrace.load.client", "infertrace.capture.client")


def external_imports(path: Path) -> set[str]:
    """Every module a file names in an import statement (at any depth), absolute, with its parents."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found


def test_results_compute_and_never_fetch():
    """load/results/ turns records into figures: it reaches no server (the targets read the request log and the
    metrics), so it imports no network library and nothing of the client package."""
    results = sorted((ROOT / "load" / "results").rglob("*.py"))
    assert results
    offending = {str(p.relative_to(ROOT)): sorted(external_imports(p) & set(NETWORK_MODULES)) for p in results}
    assert {p: mods for p, mods in offending.items() if mods} == {}
    # nor does it wait on anything: a reader handed in (a transport, a target) would fetch through it unseen
    waits = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in results
             for node in ast.walk(ast.parse(p.read_text(), str(p)))
             if isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith))]
    assert waits == []


def test_the_network_rule_catches_an_import(tmp_path):
    """The rule above sees a plain import, a from-import of a submodule, and one inside a function."""
    for text in ("import aiohttp\n", "from http.client import HTTPConnection\n",
                 "def f():\n    from infertrace.load.client.request_log import read_since\n"):
        (tmp_path / "m.py").write_text(text)
        assert external_imports(tmp_path / "m.py") & set(NETWORK_MODULES), text


def test_load_asks_its_target_and_never_probes_it():
    """A run calls the members of the Target protocol (load/client/target.py), which both targets define; it does
    not probe a target's attributes or branch on its kind."""
    probes = []
    for path in sorted((ROOT / "load").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr") and node.args and _names_target(node.args[0]):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Compare) and any(_is_kind(c) for c in (node.left, *node.comparators)):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [p for p in probes if not p.startswith(PROBES_PENDING)] == []


PROBES_PENDING: tuple[str, ...] = ()  # files still allowed to probe a target (none left)


def _names_target(node: ast.AST) -> bool:
    """`target`, `self.target`, or an attribute of either (`target.engine`)."""
    while isinstance(node, ast.Attribute):
        if node.attr == "target":
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id == "target"


def _is_kind(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "kind" and _names_target(node.value)


def test_every_command_lives_at_its_package_command_module():
    from infertrace.cli import main

    for name in main.list_commands(None):
        command = main.get_command(None, name)
        module = command.callback.__module__
        package, _, leaf = module.rpartition(".")
        assert leaf == "command" and package.count(".") == 1 and package.startswith("infertrace."), (name, module)


def test_benchmarks_import_only_names_that_exist_and_are_never_imported():
    """benchmarks/ sits above every layer: its scripts may import any module of infertrace/, each import must
    name a module or attribute that exists (a move that forgets a script fails here), and nothing in infertrace/
    imports them."""
    import importlib

    bench_dir = ROOT.parent / "benchmarks"
    wanted: set[tuple[str, str | None]] = set()
    for path in sorted(bench_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "infertrace":
                wanted.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                wanted.update((a.name, None) for a in node.names if a.name.split(".")[0] == "infertrace")
    assert wanted, "no benchmark imports infertrace: the check would hold vacuously"
    missing = []
    for module, name in sorted(wanted, key=str):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "infertrace":
                missing.append(module)
            continue  # a GPU-only dependency (triton) absent here
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] == "infertrace":
                    missing.append(f"{module}.{name}")
    assert missing == []
    assert not any("benchmarks" in t for ts in import_graph(ROOT).values() for t in ts)
