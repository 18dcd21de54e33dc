"""Optional features and the pip extra that installs each.

Serving needs none of them. A command checks its flags here before doing any work, so a
missing package is one line naming the extra to install, never a traceback halfway
through a run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from sendpath.errors import MissingExtraError

__all__ = ["EXTRAS", "Extra", "require"]


@dataclass(frozen=True)
class Extra:
    """An extra of the ``sendpath`` package: the module it provides and the flag needing it."""

    name: str
    module: str
    flag: str


EXTRAS: dict[str, Extra] = {
    "plot": Extra("plot", "matplotlib", "--plot"),
    "redis": Extra("redis", "redis", "--redis"),
}


def require(name: str) -> None:
    """Import the extra's module, or raise MissingExtraError saying how to install it."""
    extra = EXTRAS[name]
    try:
        importlib.import_module(extra.module)
    except ImportError:
        raise MissingExtraError(
            f"{extra.flag} needs {extra.module}: pip install 'sendpath[{extra.name}]'"
        ) from None
