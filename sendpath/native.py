"""Small C extensions of our own, compiled with the machine's C compiler on first use and
kept in sendpath's cache folder (``SENDPATH_CACHE_DIR``, else ``~/.cache/sendpath``).

For code that runs in a server's hot path but needs no torch (the model's kernels,
``model/kernels``, build through torch's extension builder instead): ``.c`` files and
the headers beside them, Python's own headers, no other library. The built file's name
carries a hash of the sources, those headers, the Python build, the compiler and its
flags, so an edit, another Python or another venv builds its own; several processes
starting at once each compile to a file of their own and rename it into place, so none
loads a half-written one. A built file, or its folder, that another user could have
written is not loaded (``trusted``: the simulator's mypyc build and the model's kernels
check theirs too). ``prefer`` is how a caller with a Python path beside the C one picks
between them.
"""

from __future__ import annotations

import grp
import hashlib
import importlib.machinery
import importlib.util
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "NativeBuildError",
    "build_extension",
    "cache_dir",
    "first_error",
    "prefer",
    "toolchain",
    "trusted",
]

COMPILE_TIMEOUT_S = 120
# part of the built file's hash. -Os: these run once a request amid a server's other
# work, their code cold each time; a fifth smaller, and no slower measured. Hidden
# symbols: only PyInit_* is exported, so no other library's names can take our calls
FLAGS = ("-Os", "-shared", "-fPIC", "-std=c11", "-fvisibility=hidden")


class NativeBuildError(RuntimeError):
    """The extension could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    """sendpath's cache folder (built kernels and extensions)."""
    return Path(os.environ.get("SENDPATH_CACHE_DIR") or Path.home() / ".cache" / "sendpath")


def prefer(build: Callable[[], ModuleType], source: str) -> tuple[ModuleType | None, str]:
    """``build``'s extension and "in C (``source``)", or ``None`` and "in Python (why)"
    where it cannot be built: what a caller with both paths uses, and logs."""
    try:
        return build(), f"in C ({source})"
    except NativeBuildError as exc:
        return None, f"in Python ({exc})"


def first_error(output: str, fallback: str = "no message") -> str:
    """What a failed build says went wrong: the first line of its ``output`` that says
    ``error:`` (as compilers and mypy do; not a command line's ``-Werror``), else its last
    line, else ``fallback``."""
    lines = [line.strip() for line in output.splitlines() if line.strip()] or [fallback]
    return next((line for line in lines if "error:" in line), lines[-1])


def trusted(*paths: Path) -> None:
    """Raises ``NativeBuildError`` unless each of ``paths`` (a built file, the folder that
    holds it) is this user's or root's and nobody else can write it: code another user
    could have put in a shared or misconfigured cache folder is not loaded. Writable by
    its group passes where that group is the user's own (Debian's user private groups,
    whose umask of 002 makes every file so)."""
    for path in paths:
        info = path.stat()
        others = info.st_mode & 0o002 or (info.st_mode & 0o020 and not _own_group(info.st_gid))
        if info.st_uid not in (os.getuid(), 0) or others:
            raise NativeBuildError(f"{path} could have been written by another user: not "
                                   "loaded (delete it to rebuild)")  # fmt: skip


def _own_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's alone: named as the user, no members listed."""
    try:
        group = grp.getgrgid(gid)
        return group.gr_name == pwd.getpwuid(os.getuid()).pw_name and not group.gr_mem
    except KeyError:  # a group or user with no name
        return False


def toolchain() -> tuple[list[str], str]:
    """The C compiler Python was built with (its command) and Python's C headers' folder;
    raises ``NativeBuildError`` saying what to install where either is missing."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeBuildError(
            f"Python's C headers are not in {include} (on Debian: apt install python3-dev)"
        )
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(compiler[0]) is None:
        raise NativeBuildError(f"no C compiler: {compiler[0]} is not found (on Debian: apt "
                               "install gcc)")  # fmt: skip
    return compiler, include


def build_extension(name: str, source: Path | Sequence[Path]) -> ModuleType:
    """The extension module ``name`` (one of its C sources defines ``PyInit_<name>``)
    built from ``source`` (one file or several, whose folders are searched for headers),
    compiled here once; raises ``NativeBuildError`` saying what is missing. A built file
    that does not load (cut short, say) is built again, once."""
    sources = [source] if isinstance(source, Path) else list(source)
    compiler, include = toolchain()
    folders = sorted({str(path.parent) for path in sources})
    key = hashlib.sha256()
    for path in [*sources, *sorted(h for f in folders for h in Path(f).glob("*.h"))]:
        key.update(path.read_bytes())
    for part in (sys.version, sys.prefix, include, " ".join(compiler), " ".join(FLAGS)):
        key.update(part.encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    try:
        target = cache_dir() / "native" / f"{name}-{key.hexdigest()[:12]}{suffix}"
        if not target.exists():
            _compile(compiler, [include, *folders], sources, target)
        trusted(target.parent, target)
        try:
            return _load(name, target)
        except ImportError:  # cut short, say: built again, once
            target.unlink(missing_ok=True)
        _compile(compiler, [include, *folders], sources, target)
        trusted(target)
        try:
            return _load(name, target)
        except ImportError as exc:
            raise NativeBuildError(f"{target} does not load: {exc}") from exc
    except NativeBuildError:
        raise
    except (OSError, RuntimeError) as exc:  # no home, a cache folder that cannot be written
        raise NativeBuildError(f"cannot keep a built {sources[0].name}: {exc}") from exc


def _load(name: str, target: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, target)
    if spec is None or spec.loader is None:
        raise ImportError(f"{target} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)  # an extension is opened here
    spec.loader.exec_module(module)
    return module


def _compile(compiler: list[str], includes: list[str], sources: list[Path], target: Path) -> None:
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name, suffix=".partial", dir=target.parent)
    os.close(fd)
    command = [*compiler, *FLAGS]
    command += [f"-I{folder}" for folder in includes]
    command += [*map(str, sources), "-o", partial]
    names = ", ".join(path.name for path in sources)
    try:
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeBuildError(f"{compiler[0]} could not compile {names}: {exc}") from exc
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler[0]} failed on {names}: {first_error(done.stderr)}")
        os.chmod(partial, 0o755)  # mkstemp made it 0600: others sharing the cache load it
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
