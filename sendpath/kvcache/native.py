"""``kv_native.c``: the prefix cache's block hashes and block pool in C, built on first
import where a C compiler is found (``sendpath/native.py``), else ``None`` and the Python
versions are used (``HOW`` says which, and why)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from sendpath.native import build_extension, prefer

__all__ = ["HOW", "build", "kv_native"]


def build() -> ModuleType:
    """Builds (once) and loads ``kv_native.c``; raises ``NativeBuildError`` saying why not."""
    return build_extension("_sendpath_kv", Path(__file__).with_name("kv_native.c"))


kv_native: ModuleType | None
if os.environ.get("SENDPATH_NATIVE_KV", "1") == "0":
    kv_native, HOW = None, "in Python (SENDPATH_NATIVE_KV=0)"
else:
    kv_native, HOW = prefer(build, "kvcache/kv_native.c")
