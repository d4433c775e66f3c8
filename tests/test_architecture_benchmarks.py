"""benchmarks/ measures infertrace from outside: its scripts use infertrace's public names only, change nothing in
it (no monkeypatching of its modules, classes or objects), and nothing in infertrace/ imports them. A benchmark that
needs a stage timed reads what the product reports (the request log, the engine's counters), so a refactor of a
private function cannot silently stop a benchmark measuring what it says it measures."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat: list[ast.AST] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target)
    return flat


def violations(source: str, filename: str = "<script>") -> list[str]:
    """What in one benchmark script reaches into infertrace: `file:line what`."""
    tree = ast.parse(source, filename)
    # names bound to an infertrace module, class or function anywhere in the file (imports inside functions too)
    bound: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "infertrace":
            private_parts = [p for p in node.module.split(".") if _private(p)]
            if private_parts:
                found.append(f"{filename}:{node.lineno} imports the private module {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{filename}:{node.lineno} imports the private name {node.module}.{alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "infertrace":
                    continue
                if any(_private(p) for p in alias.name.split(".")):
                    found.append(f"{filename}:{node.lineno} imports the private module {alias.name}")
                bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and _root_name(target) in bound:
                found.append(f"{filename}:{node.lineno} assigns {ast.unparse(target)} (monkeypatching infertrace)")
            elif isinstance(target, ast.Attribute) and _private(target.attr) and _root_name(target) not in ("self", "cls"):
                found.append(f"{filename}:{node.lineno} assigns the private attribute {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if not (node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
                found.append(f"{filename}:{node.lineno} calls {ast.unparse(node)} (monkeypatching)")
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr)
              and _root_name(node) not in ("self", "cls")):
            found.append(f"{filename}:{node.lineno} reads the private attribute {ast.unparse(node)}")
    return sorted(set(found))


def test_benchmarks_use_infertrace_public_names_only_and_patch_nothing():
    scripts = sorted(BENCHMARKS.rglob("*.py"))
    assert len(scripts) > 10, "benchmarks/ holds no scripts: the check would hold vacuously"
    found = [v for path in scripts for v in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_infertrace_never_imports_benchmarks():
    importers = []
    for path in sorted((ROOT / "infertrace").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n.split(".")[0] == "benchmarks" for n in names):
                importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert importers == []


# How the rules read the forms a timing script is tempted to use. The first three are what request_path.py did to
# time a request's stages before the server's request log carried those times.
PATCHING = {
    "a module's private function": """
        from infertrace.server.frontend import app
        app._json_body = lambda request: None
    """,
    "a class's methods, through a tuple": """
        from infertrace.server.engine_link import client as engine_client
        engine_client.ProcessEngine.generate, engine_client.ProcessEngine.send = None, None
    """,
    "a private name imported": """
        def main():
            from infertrace.server.engine_link.process import EngineLoop, _tell_all
    """,
    "a private attribute read": """
        def wrap(loop_cls):
            handle = loop_cls._handle
    """,
    "a class method replaced by setattr": """
        from infertrace.engine import engine
        for name in ("step",):
            setattr(engine.Engine, name, None)
    """,
    "a module constant changed": """
        import infertrace.server.frontend.state as state
        state.INLINE_TOKENIZE_CHARS = 0
    """,
    "an instance's private attribute set": """
        def f(llm):
            llm.engine._step = None
    """,
}


def test_each_way_of_patching_is_caught():
    for what, source in PATCHING.items():
        assert violations(textwrap.dedent(source)), what


def test_public_use_passes():
    source = textwrap.dedent("""
        from infertrace.engine import LLM, SamplingParams
        from infertrace.engine.kernels import tuning

        class Timer:
            def __init__(self):
                self._start = 0.0
                setattr(self, "on", False)

        def main(args):
            llm = LLM(args.model)
            args.tp = "1"
            llm.engine.add_request("r0", [1, 2], SamplingParams(max_tokens=4))
            return tuning.__name__
    """)
    assert violations(source) == []
