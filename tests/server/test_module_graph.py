"""The server's modules import in one direction: no import cycle among forkpoint/server/*.py
(function-level imports included, since a cycle through a lazy import is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import forkpoint.server

SERVER = Path(forkpoint.server.__file__).parent


def server_imports() -> dict[str, set[str]]:
    """{module name: server modules it imports anywhere in its body}."""
    names = {path.stem for path in SERVER.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in SERVER.glob("*.py"):
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[:2] == ["forkpoint", "server"] and len(parts) == 3 and parts[2] in names:
                    edges.add(parts[2])
        graph[path.stem] = edges - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycle_between_server_modules():
    graph = server_imports()
    assert "cli" in graph and "bench_cli" in graph["cli"]  # the walk sees the modules it must
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
