"""The package's import graph: no cycles (counting imports inside functions, which only
hide a cycle), and no edge that runs the wrong way between its layers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "sendpath"


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports() -> dict[str, set[str]]:
    """Each module -> the sendpath modules it imports anywhere but under TYPE_CHECKING."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hidden = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sendpath"):
                base = node.module or ""
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("sendpath.")}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_cycle() -> None:
    graph = imports()
    assert len(graph) > 100
    assert cycles(graph) == []


def test_the_layers_import_downwards() -> None:
    graph = imports()

    def below(package: str, forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
        return [
            (m, dep)
            for m, deps in graph.items()
            if m.startswith(package)
            for dep in deps
            if dep.startswith(forbidden)
        ]

    # the router is plain policy over endpoints: it reads no HTTP body, no server
    assert below("sendpath.router", ("sendpath.api", "sendpath.gateway", "sendpath.server")) == []
    # the gateway talks to replicas over HTTP only: nothing of the replica server
    assert below("sendpath.gateway", ("sendpath.server",)) == []
    # the engine and the KV cache know nothing of either server
    assert below("sendpath.engine", ("sendpath.gateway", "sendpath.server")) == []
    assert (
        below("sendpath.kvcache", ("sendpath.gateway", "sendpath.server", "sendpath.engine")) == []
    )


def test_the_gateway_forward_path_runs_one_way() -> None:
    """The proxy uses the attempt and the relay; they report to the outcome and return
    plain data, and none of them imports the proxy (not even for a type)."""
    forward = ("attempt", "relay", "outcome", "output_filter", "verdict", "chunks")
    for name in forward:
        source = (ROOT / "gateway" / f"{name}.py").read_text()
        assert "gateway.proxy" not in source, name
    graph = imports()
    assert "sendpath.gateway.relay" not in graph["sendpath.gateway.attempt"]
    assert "sendpath.router.router" not in graph["sendpath.gateway.attempt"]  # no feedback
