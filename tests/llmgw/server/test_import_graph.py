"""The control plane's modules import each other in one direction: no circle, counting imports
made only for type checking, and nothing imports `llmgw.server.app` (the root that wires them).
Read from the sources' syntax trees, so a circle hidden behind `TYPE_CHECKING` is found too."""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw.server
import llmgw.server.app  # (under Pants: brings every module the control plane uses into the sandbox)


def modules(package: Path, prefix: str) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        name = ".".join((prefix, *parts))
        found[name.removesuffix(".__init__")] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in out if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def server_graph() -> dict[str, set[str]]:
    known = modules(Path(llmgw.server.__file__).parent, "llmgw.server")
    return {name: imported(name, path, known) for name, path in known.items()}


def test_the_control_planes_modules_form_no_import_circle() -> None:
    graph = server_graph()
    assert "llmgw.server.admin.api" in graph and "llmgw.server.state.drains" in graph  # the scan saw the package
    assert circles(graph) == []
    assert sorted(n for n, deps in graph.items() if "llmgw.server.app" in deps) == []


def test_the_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
