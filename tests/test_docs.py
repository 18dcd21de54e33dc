"""docs/architecture.md names real files and real code: every path it gives exists, and
every class, ``Class.method`` and ``function(...)`` it names is defined in the package."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "architecture.md"
CLASS = re.compile(r"^[A-Z][A-Za-z0-9]+$")
METHOD = re.compile(r"^([A-Z][A-Za-z0-9]+)\.([A-Za-z_][A-Za-z0-9_]*)$")
FUNCTION = re.compile(r"^([a-z_][a-z0-9_]*)$")


@cache
def sources() -> dict[Path, str]:
    return {p: p.read_text() for p in (ROOT / "sendpath").rglob("*.py")}


def names() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC.read_text())


def defines_class(name: str) -> list[str]:
    pattern = re.compile(rf"^(class {name}\b|{name}(: [^=]+)? = )", re.M)
    return [text for text in sources().values() if pattern.search(text)]


def test_every_path_exists() -> None:
    paths = [n for n in names() if re.match(r"^(sendpath|benchmarks|tests|docs)/", n)]
    assert len(paths) > 20
    missing = [p for p in paths if not (ROOT / p.split(" ")[0]).exists()]
    assert not missing, missing


def test_every_class_method_and_function_is_defined() -> None:
    missing, checked = [], 0
    for raw in names():
        raw = raw.split(" = ")[-1]  # `plan = Scheduler.schedule()`: the call
        if raw in ("None", "True", "False"):
            continue
        name = re.sub(r"\(.*\)$", "", raw.split(" ")[0])
        called = raw.endswith(")")
        if method := METHOD.match(name):
            owner, attribute = method.groups()
            found = [
                text
                for text in defines_class(owner)
                if re.search(rf"(def {attribute}\b|\b{attribute}\b *[:=])", text)
            ]
        elif CLASS.match(name) and not name.isupper():
            found = defines_class(name)
        elif called and FUNCTION.match(name):
            pattern = re.compile(rf"^\s*(async )?def {name}\b", re.M)
            found = [text for text in sources().values() if pattern.search(text)]
        else:
            continue
        checked += 1
        if not found:
            missing.append(raw)
    assert checked > 30
    assert not missing, missing
