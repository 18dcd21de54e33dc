"""Who writes the gateway's per-request context: each field one module, and the answer
side (from ``attempts`` on, as ``GatewayContext`` lists it) only ``outcome.Outcome``."""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

from sendpath.gateway.context import GatewayContext

GATEWAY = Path(__file__).parents[2] / "sendpath" / "gateway"
MUTATORS = {"append", "extend", "clear", "pop", "update", "setdefault", "insert", "remove"}


def writers() -> dict[str, set[str]]:
    """Each context field -> the gateway modules that assign it, add to it or mutate it
    through a name ``ctx`` (or ``self.ctx``)."""
    out: dict[str, set[str]] = defaultdict(set)

    def field_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("ctx", "self.ctx"):
            return node.attr
        return None

    for path in GATEWAY.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    targets += t.elts if isinstance(t, ast.Tuple) else [t]
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
            ):
                targets = [node.func.value]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                targets = [node.value]
            for target in targets:
                name = field_of(target)
                if name is not None:
                    out[name].add(path.stem)
    return out


def test_the_finder_sees_each_kind_of_write() -> None:
    found = writers()
    assert found["usage"] == {"outcome"}  # an assignment
    assert found["streamed_chunks"] == {"outcome"}  # +=
    assert found["relayed"] == {"outcome"}  # .append
    assert found["body"] == {"middleware"}  # a tuple target


def test_each_context_field_has_one_writer() -> None:
    found = writers()
    fields = [f.name for f in dataclasses.fields(GatewayContext)]
    assert set(found) <= set(fields)  # the finder reads real fields
    assert {name: mods for name, mods in found.items() if len(mods) > 1} == {}
    answer_side = fields[fields.index("attempts") :]
    computed = {"end", "final"}  # written by ``GatewayContext.finish``, which only Outcome calls
    assert {f: found[f] for f in answer_side if f in found and f not in computed} == {
        f: {"outcome"} for f in answer_side if f in found and f not in computed
    }
