"""The package's shape: no module imports another that (directly or through others) imports it back,
counting imports inside functions too (a lazy import hides a cycle, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "linearize"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules ``name`` imports anywhere in its source (relative and absolute imports)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    # a module importing its own package (or a parent) is not an edge: the package is loaded first
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "linearize.injection" in graph["linearize.gated"]  # the scan sees the imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_docs_layout_names_every_module_and_no_missing_one():
    """The "Layout" table of docs/layout.md matches the tree: every module of the package is named there (a
    top-level one by its path, one in a subpackage by its file name in that subpackage's row), and
    every ``*.py`` the table names exists."""
    import re

    page = (PACKAGE.parent / "docs" / "layout.md").read_text(encoding="utf-8")
    layout = page.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `linearize/([\w/]+?)/?`.*$", layout, re.M)}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            if rel.name != "__init__.py" and f"`linearize/{rel.name}`" not in layout:
                missing.append(str(rel))
        elif rel.parts[0] not in rows or (rel.name not in ("__init__.py",) and f"`{rel.name}`" not in rows[rel.parts[0]]):
            missing.append(str(rel))
    assert not missing, f"docs/layout.md does not name {missing}"
    named = set(re.findall(r"`linearize/([\w/]+\.py)`", layout))
    for sub, row in rows.items():
        named |= {f"{sub}/{f}" for f in re.findall(r"`(\w+\.py)`", row)}
    stale = sorted(n for n in named if not (PACKAGE / n).is_file())
    assert not stale, f"docs/layout.md names files that do not exist: {stale}"
