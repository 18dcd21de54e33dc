"""The simulator's hot path compiled by mypyc, from the same sources the server runs.

A fleet-mode run spends most of its time in plain Python: the simulator's event loop,
decode lane, traffic and results, and the server's modules they call on every event (the
scheduler, the KV manager, ``Request``, the trace, the router's policies, the report):
``GROUP``. mypyc (it comes with mypy) compiles those typed modules
to C that computes the same results (it adds type checks at run time, and a compiled
class's methods cannot be replaced): 1.4-2.5x faster in fleet mode, measured in
``benchmarks/sim_speed.py``. ``use()`` builds them once into sendpath's cache folder
(about half a minute on 2 cores; the folder's name carries a hash of the sources, this
file, Python and mypy, so an edit builds afresh) and makes this process import the built
modules instead of the ``.py`` files. Only the simulator asks (`sendpath sim`,
``benchmarks/sim_speed.py``); servers and tests import the sources as always.

The modules are one mypyc group: compiled code reaches the others' classes directly, so
all of them load compiled or none do. ``use()`` must run before any of them is imported;
where one already is, it says so and the run stays in Python. Modules outside the group
(configs, errors, numpy) are typed ``Any`` in the build (``--follow-imports=skip``): that
keeps a build to seconds of type checking. A build is checked in a process of its own
before it is kept, and one that failed is remembered (its reason is kept beside the
builds; delete that file to try again). Set ``SENDPATH_SIM_COMPILED=0`` to run in Python.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

from sendpath.native import NativeBuildError, cache_dir, first_error, toolchain, trusted

__all__ = ["GROUP", "build", "how", "use"]

GROUP = (
    "sendpath.clock",
    "sendpath.trace",
    "sendpath.request",
    "sendpath.engine.queue",
    "sendpath.engine.scheduler",
    "sendpath.engine.steps",
    "sendpath.kvcache.manager",
    "sendpath.router.route",
    "sendpath.router.pool",
    "sendpath.router.kv_index",
    "sendpath.router.prefix_aware",
    "sendpath.router.policy",
    "sendpath.bench.report",
    "sendpath.sim.cost_model",
    "sendpath.sim.tenant_limits",
    "sendpath.sim.traffic",
    "sendpath.sim.results",
    "sendpath.sim.decode_lane",
    "sendpath.sim.replica_state",
    "sendpath.sim.simulator",
)
BUILD_TIMEOUT_S = 600
# The build's settings, part of the key through this file's hash: mypyc -O2 (-O3 ran no
# faster here and builds slower); no fused multiply-adds, which Python never does, so the
# compiled floats are Python's to the last bit wherever the compiler could fuse them
MYPYC_ENV = {"MYPYC_OPT_LEVEL": "2", "MYPYC_DEBUG_LEVEL": "0", "CFLAGS": "-ffp-contract=off"}
ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the sendpath package
_DONE = "complete"  # written last: a folder without it is a build cut short

_state: str | None = None  # what use() answered in this process


def _source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _key(modules: Sequence[str]) -> str:
    """The build's name: what it is built from and by, hashed."""
    try:
        mypy = importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError as exc:
        raise NativeBuildError("mypyc is not installed (pip install 'mypy[mypyc]')") from exc
    key = hashlib.sha256()
    for part in (sys.version, sys.prefix, mypy, " ".join(toolchain()[0])):
        key.update(part.encode())
    key.update(Path(__file__).read_bytes())
    for module in modules:
        key.update(module.encode())
        key.update(_source(module).read_bytes())
    return key.hexdigest()[:12]


def build(
    modules: Sequence[str] = GROUP, announce: Callable[[str], None] | None = None
) -> dict[str, Path]:
    """The group compiled (once; kept in the cache folder): each module's name, and the
    group's shared library's, to its built file; ``announce`` is told before a build
    starts. Raises ``NativeBuildError`` saying why it cannot be built or used here."""
    try:
        target = cache_dir() / "mypyc" / f"sim-{_key(modules)}"
        failed = target.with_name(target.name + ".failed")
        if failed.exists():
            raise NativeBuildError(f"{failed.read_text().strip()}; delete {failed} to try again")
        if not (target / _DONE).exists():
            if announce is not None:
                announce(f"compiling the simulator with mypyc into {target.parent}, once "
                         "for these sources (about half a minute)")  # fmt: skip
            try:
                _compile(modules, target)
            except _TimedOut:
                raise  # a busy machine, say: tried again next time
            except NativeBuildError as exc:  # _compile made the folder first
                failed.write_text(str(exc) + "\n")
                raise
        return _built(modules, target)
    except NativeBuildError:
        raise
    except (OSError, RuntimeError) as exc:  # no home, a cache folder that cannot be written
        raise NativeBuildError(f"cannot keep the compiled simulator: {exc}") from exc


class _TimedOut(NativeBuildError):
    """A build cut short by its time limit: not remembered as a failure."""


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``command`` in a process group of its own, all of it killed on a timeout (mypyc's
    compiler runs are its grandchildren)."""
    pipe = subprocess.PIPE
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=True,
                          start_new_session=True) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise _TimedOut(f"mypyc took over {BUILD_TIMEOUT_S} s") from exc
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _reason(done: subprocess.CompletedProcess[str]) -> str:
    """What went wrong in a failed run: the compiler's complaints come on stderr, mypy's
    on stdout."""
    return first_error(done.stderr + "\n" + done.stdout, f"exit status {done.returncode}")


def _compile(modules: Sequence[str], target: Path) -> None:
    """Build in a folder of its own beside ``target``, check that it loads, then rename
    it into place: several processes building at once each finish their own, and the
    first rename wins."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=target.name, suffix=".partial", dir=target.parent))
    try:
        files = []
        for module in modules:  # the sources, and the packages' names mypyc reads them by
            parts = module.split(".")
            for depth in range(1, len(parts)):
                package = work.joinpath(*parts[:depth])
                package.mkdir(exist_ok=True)
                (package / "__init__.py").touch()
            copy = work.joinpath(*parts).with_suffix(".py")
            shutil.copyfile(_source(module), copy)
            files.append(str(copy.relative_to(work)))
        # a config of its own: else mypy reads one from any folder above the cache's
        (work / "mypy.ini").write_text("[mypy]\n")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MYPYC_") and k not in ("CC", "CFLAGS", "LDFLAGS")}  # fmt: skip
        env.update(MYPYC_ENV)
        skip = ["--follow-imports=skip", "--ignore-missing-imports"]  # the rest as Any
        done = _run([sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *skip, *files],
                    work, env)  # fmt: skip
        if done.returncode != 0:
            raise NativeBuildError(f"mypyc failed on the simulator: {_reason(done)}")
        shutil.rmtree(work / "build")  # what the built files came from: C, objects,
        shutil.rmtree(work / ".mypy_cache")  # mypy's cache, its config, the sources copied
        (work / "mypy.ini").unlink()
        for path in work.rglob("*.py"):
            path.unlink()
        _check(modules, work)
        (work / _DONE).touch()
        for path in work.rglob("*"):  # as the user's umask made them: none writable by others
            path.chmod(path.stat().st_mode & ~0o022)
        os.chmod(work, 0o755)  # mkdtemp made it 0700: others sharing the cache load it
        try:
            work.rename(target)
        except OSError:  # another process finished first: its build is the same
            if not (target / _DONE).exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check(modules: Sequence[str], folder: Path) -> None:
    """Import the whole build in a fresh process: one that does not load is never kept."""
    files = {name: str(path) for name, path in _files(modules, folder).items()}
    code = (
        "import importlib, sys\n"
        "from sendpath.sim.compiled import _Finder\n"
        f"sys.meta_path.insert(0, _Finder({files!r}))\n"
        f"for name in {list(modules)!r}:\n"
        "    assert not importlib.import_module(name).__file__.endswith('.py'), name\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    done = _run([sys.executable, "-c", code], ROOT, env)
    if done.returncode != 0:
        raise NativeBuildError(f"the compiled simulator does not load: {_reason(done)}")


def _files(modules: Sequence[str], folder: Path) -> dict[str, Path]:
    """Each module's built file in ``folder``, and the group's shared library's."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    files = {m: folder.joinpath(*m.split(".")).with_name(m.rsplit(".", 1)[1] + suffix)
             for m in modules}  # fmt: skip
    shared = list(folder.glob(f"*__mypyc{suffix}"))
    if len(shared) != 1 or not all(path.exists() for path in files.values()):
        raise NativeBuildError(f"{folder} does not hold a whole build (delete it to rebuild)")
    files[shared[0].name.removesuffix(suffix)] = shared[0]
    return files


def _built(modules: Sequence[str], target: Path) -> dict[str, Path]:
    """The kept build's files, where only this user (or root) could have written them."""
    files = _files(modules, target)
    trusted(target, *files.values())
    return files


class _Finder(importlib.abc.MetaPathFinder):
    """Imports the group's modules from their built files."""

    def __init__(self, files: dict[str, Path] | dict[str, str]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


def how() -> str:
    """How this process's simulator runs: what ``use()`` answered, if it was asked."""
    return _state or "in Python (the compiled modules were not asked for)"


def use(announce: Callable[[str], None] | None = None) -> str:
    """Make this process import the compiled group (built first where it is not yet;
    ``announce`` is told before a build starts); how the simulator runs: "compiled by
    mypyc" or "in Python (why)"."""
    global _state
    if _state is None:
        _state = _use(announce)
    return _state


def _use(announce: Callable[[str], None] | None) -> str:
    if os.environ.get("SENDPATH_SIM_COMPILED", "1") == "0":
        return "in Python (SENDPATH_SIM_COMPILED=0)"
    loaded = next((m for m in GROUP if m in sys.modules), None)
    if loaded is not None:
        return f"in Python ({loaded} was imported before the compiled modules could be)"
    try:
        files = build(GROUP, announce)
    except NativeBuildError as exc:
        return f"in Python ({exc})"
    finder, before = _Finder(files), set(sys.modules)
    sys.meta_path.insert(0, finder)
    try:  # all of the group now, while nothing uses it yet (the build loaded when checked)
        for module in GROUP:
            importlib.import_module(module)
    except Exception as exc:
        sys.meta_path.remove(finder)
        _forget({n for n in set(sys.modules) - before if n in files or n.startswith("sendpath.")})
        return f"in Python (the compiled modules do not load: {exc})"
    return "compiled by mypyc"


def _forget(names: set[str]) -> None:
    """Drop these modules, from ``sys.modules`` and as their packages' attributes: the
    group's, and sendpath's that the attempt imported (they may hold the group's objects).
    Not numpy and the like, which cannot be imported twice and hold none of ours."""
    for name in names:
        parent, _, child = name.rpartition(".")
        module = sys.modules.pop(name)
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
            delattr(sys.modules[parent], child)
