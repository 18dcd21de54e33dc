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
    """An extra of the ``sendpath`` package: the modules it provides (the first named in
    the message, or ``needs``) and the flag needing it."""

    name: str
    modules: tuple[str, ...]
    flag: str
    needs: str | None = None  # what the message says is missing (default: the first module)


EXTRAS: dict[str, Extra] = {
    "plot": Extra("plot", ("matplotlib",), "--plot"),
    "redis": Extra("redis", ("redis",), "--redis"),
    "kv-events": Extra("kv-events", ("zmq", "msgpack"), "--kv-events-config", "pyzmq and msgpack"),
    "ray": Extra("ray", ("ray.serve",), "--ray", "Ray Serve"),
    "otel": Extra(
        "otel",
        ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
        "--otlp-traces-endpoint",
        "the OpenTelemetry SDK and its OTLP/HTTP exporter",
    ),
}


def require(name: str) -> None:
    """Import the extra's modules, or raise MissingExtraError saying how to install it."""
    extra = EXTRAS[name]
    try:
        for module in extra.modules:
            importlib.import_module(module)
    except ImportError:
        needs = extra.needs or extra.modules[0]
        raise MissingExtraError(
            f"{extra.flag} needs {needs}: pip install 'sendpath[{extra.name}]'"
        ) from None
