"""Small C extensions of our own, compiled with the machine's C compiler on first use and
kept in sendpath's cache folder (``SENDPATH_CACHE_DIR``, else ``~/.cache/sendpath``).

For code that runs in a server's hot path but needs no torch (the model's kernels,
``model/kernels``, build through torch's extension builder instead): one ``.c`` file,
Python's own headers, no other library. The built file's name carries a hash of the
source, the Python build and the compiler, so an edit, another Python or another venv
builds its own; several processes starting at once each compile to a file of their
own and rename it into place, so none loads a half-written one.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["NativeBuildError", "build_extension", "cache_dir"]

COMPILE_TIMEOUT_S = 120


class NativeBuildError(RuntimeError):
    """The extension could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    """sendpath's cache folder (built kernels and extensions)."""
    return Path(os.environ.get("SENDPATH_CACHE_DIR") or Path.home() / ".cache" / "sendpath")


def build_extension(name: str, source: Path) -> ModuleType:
    """The extension module ``name`` (its C source defines ``PyInit_<name>``) built from
    ``source``, compiled here once; raises ``NativeBuildError`` saying what is missing."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeBuildError(
            f"Python's C headers are not in {include} (on Debian: apt install python3-dev)"
        )
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    key = hashlib.sha256(source.read_bytes())
    for part in (sys.version, sys.prefix, include, " ".join(compiler)):
        key.update(part.encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = cache_dir() / "native" / f"{name}-{key.hexdigest()[:12]}{suffix}"
    if not target.exists():
        _compile(compiler, include, source, target)
    spec = importlib.util.spec_from_file_location(name, target)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"{target} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise NativeBuildError(f"{target} does not load: {exc}") from exc
    return module


def _compile(compiler: list[str], include: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name, suffix=".partial", dir=target.parent)
    os.close(fd)
    command = [
        *compiler, "-O2", "-shared", "-fPIC", "-std=c11", "-I", include, str(source),
        "-o", partial,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(partial)
        raise NativeBuildError(f"{compiler[0]} could not compile {source.name}: {exc}") from exc
    if done.returncode != 0:
        os.unlink(partial)
        lines = done.stderr.strip().splitlines() or ["no message"]
        first = next((line for line in lines if "error" in line), lines[-1]).strip()
        raise NativeBuildError(f"{compiler[0]} failed on {source.name}: {first}")
    os.replace(partial, target)
