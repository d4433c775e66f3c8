"""The front door stays a front door: the README's two commands are the ones CI runs, the README and the current
figures stay short, and every relative link and #anchor between the project's markdown files resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = "pip install torch==2.13.0 && pip install -e . && infertrace bench --concurrency 8"
TEST_COMMAND = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"
MAX_LINES = 150


def _markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(ROOT.glob("recipes/**/*.md"))]
    return [f for f in files if f.exists()]


def _slugs(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    out, seen, in_code = set(), {}, False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _broken_links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert MAIN_JOB in readme
    assert TEST_COMMAND in readme
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("name", ["README.md", "docs/benchmarks.md"])
def test_front_pages_stay_short(name):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} is {lines} lines; history belongs in docs/benchmarks-history.md"


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(md):
    assert _broken_links(md) == []


def test_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n[ok](#title) [gone](b.md) [no anchor](#nope)\n")
    assert _broken_links(tmp_path / "a.md") == ["b.md (no such file)", "#nope (no such heading)"]


def test_every_shipped_recipe_is_named_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.stem for p in sorted((ROOT / "recipes").glob("*.yaml")) if p.stem not in readme]
    assert missing == []
