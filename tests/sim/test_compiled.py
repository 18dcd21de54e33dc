"""The simulator compiled by mypyc (``sim/compiled.py``) gives the Python run's answers to
the last bit, builds afresh when a source changes, and says why where it cannot be used.

The tests' own process runs the sources (conftest sets ``SENDPATH_SIM_COMPILED=0``: a
compiled group cannot have its methods replaced, as some tests do); the compiled runs
are in processes of their own. Nothing here imports the group at the top: ``fingerprint``
is what a child process imports after ``use()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sendpath.native import NativeBuildError
from sendpath.sim import compiled

REPO = Path(__file__).resolve().parents[2]


def fingerprint() -> list[Any]:
    """Everything a run reports, for runs that reach preemptions, chunked prompts beside
    parked decodes, prefix-aware routing over multi-turn conversations, tenants' limits
    and both cost models' step pricing, in both modes."""
    from sendpath.config import SchedulerConfig
    from sendpath.sim.calibrated import Calibrated
    from sendpath.sim.cost_model import Roofline
    from sendpath.sim.gpu_model import GpuStep, calibration
    from sendpath.sim.hardware import hardware, model_spec
    from sendpath.sim.simulator import SimConfig, Simulator
    from tests.sim.cases import CHUNKED, mixed_traffic

    traffic = mixed_traffic(200)
    model, h100 = model_spec("llama-3.1-8b"), hardware("H100")
    roofline = Roofline(model, h100)
    fitted = GpuStep(model, h100, 1, "bf16", calibration().efficiency)
    calibrated = Calibrated(
        {"step": 0.04, "prompt": 0.0015, "context": 1e-9, "kv": 1e-5, "decode": 0.002}
    )
    out: list[Any] = []
    for cost, num_blocks, sched, tpm in ((roofline, 400, CHUNKED, None),
                                         (calibrated, 20_000, SchedulerConfig(), None),
                                         (fitted, 20_000, SchedulerConfig(), 3_000)):  # fmt: skip
        for mode in ("detailed", "fleet"):
            config = SimConfig(replicas=3, num_blocks=num_blocks, mode=mode, tpm=tpm,
                               policy="prefix_aware", scheduler=sched)  # fmt: skip
            result = Simulator(config, cost).run(traffic)
            assert (result.rate_limited > 0) == (tpm is not None)  # the limits bite
            requests = sorted(
                (r.request_id or "", r.status, r.ttft, r.latency, list(r.itl), r.timings)
                for r in result.results
            )
            out.append([requests, result.num_steps, result.busy, result.kv_peak,
                        result.rejected, result.rate_limited, result.report])  # fmt: skip
    return out


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=900)  # fmt: skip


def test_the_compiled_simulator_gives_the_python_answers() -> None:
    child = _child(
        "import json, sys\n"
        "from sendpath.sim.compiled import GROUP, use\n"
        "how = use()\n"
        "from tests.sim.test_compiled import fingerprint\n"
        "files = [sys.modules[m].__file__ for m in GROUP]\n"
        "print(json.dumps({'how': how, 'files': files, 'runs': fingerprint()}))\n",
        SENDPATH_SIM_COMPILED="1",
    )
    assert child.returncode == 0, child.stderr[-2000:]
    found = json.loads(child.stdout.splitlines()[-1])
    assert found["how"] == "compiled by mypyc", found["how"]
    assert not any(file.endswith(".py") for file in found["files"])  # built, not the sources
    # JSON both ways: floats round-trip exactly, tuples become lists
    assert found["runs"] == json.loads(json.dumps(fingerprint()))


def test_it_is_not_used_after_a_module_of_its_group_was_imported() -> None:
    child = _child(
        "import sendpath.clock\n"
        "from sendpath.sim.compiled import use, how\n"
        "print(use()); print(how())\n",
        SENDPATH_SIM_COMPILED="1",
    )
    assert child.returncode == 0, child.stderr[-2000:]
    said = "in Python (sendpath.clock was imported before the compiled modules could be)"
    assert child.stdout.splitlines() == [said, said]
    off = _child("from sendpath.sim.compiled import use\nprint(use())\n", SENDPATH_SIM_COMPILED="0")
    assert off.stdout.strip() == "in Python (SENDPATH_SIM_COMPILED=0)"


def test_the_cli_says_how_the_simulator_ran() -> None:
    child = _child(
        "from sendpath.cli import main\nmain(['sim', '--scenario', 'quiet'])\n",
        SENDPATH_SIM_COMPILED="1",
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "(fleet mode, compiled by mypyc)" in " ".join(child.stdout.split())


def _tree(root: Path, modules: dict[str, str]) -> None:
    for module, text in modules.items():
        path = root.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_an_edited_source_is_a_build_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiled, "ROOT", tmp_path)
    _tree(tmp_path, {"pkg.a": "X = 1\n", "pkg.b": "Y = 2\n"})
    before = compiled._key(["pkg.a", "pkg.b"])
    assert compiled._key(["pkg.a", "pkg.b"]) == before  # the same sources, the same build
    _tree(tmp_path, {"pkg.b": "Y = 3\n"})
    assert compiled._key(["pkg.a", "pkg.b"]) != before


def test_a_build_that_fails_says_why_and_is_not_tried_again_until_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiled, "ROOT", tmp_path / "src")
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(tmp_path / "cache"))
    _tree(tmp_path / "src", {"pkg.bad": 'x: int = "one"\n'})
    told: list[str] = []
    with pytest.raises(NativeBuildError, match=r"mypyc failed on the simulator: .*"
                       r"Incompatible types in assignment"):  # fmt: skip
        compiled.build(["pkg.bad"], told.append)
    assert len(told) == 1 and "compiling the simulator with mypyc" in told[0]
    # no half-built folder; the reason is kept, and said again without a build
    (failed,) = (tmp_path / "cache" / "mypyc").iterdir()
    assert failed.name.endswith(".failed")
    with pytest.raises(NativeBuildError, match=r"Incompatible types.*; delete .*\.failed to try"):
        compiled.build(["pkg.bad"], told.append)
    assert len(told) == 1
    failed.unlink()
    with pytest.raises(NativeBuildError, match=r"mypyc failed on the simulator"):
        compiled.build(["pkg.bad"], told.append)
    assert len(told) == 2  # tried again


def test_a_small_group_builds_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "ROOT", tmp_path / "src")
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(tmp_path / "cache"))
    _tree(tmp_path / "src", {
        "pkg.one": "def twice(n: int) -> int:\n    return 2 * n\n",
        "pkg.two": "from pkg.one import twice\n\ndef four(n: int) -> int:\n"
                   "    return twice(twice(n))\n",
    })  # fmt: skip
    told: list[str] = []
    umask = os.umask(0o002)  # a user whose files are group-writable: the build is not
    try:
        files = compiled.build(["pkg.one", "pkg.two"], told.append)
    finally:
        os.umask(umask)
    assert set(files) >= {"pkg.one", "pkg.two"} and len(files) == 3  # and the shared library
    assert all(path.stat().st_mode & 0o022 == 0 for path in files.values())
    assert compiled.build(["pkg.one", "pkg.two"], told.append) == files
    assert len(told) == 1  # kept: not built again
    assert sorted(p.name for p in files["pkg.one"].parent.iterdir()) == [
        files["pkg.one"].name,
        files["pkg.two"].name,
    ]  # only what loads: no sources, no C
    paths = {name: str(path) for name, path in files.items()}
    code = (
        "import sys\n"
        "from sendpath.sim.compiled import _Finder\n"
        f"sys.meta_path.insert(0, _Finder({paths!r}))\n"
        f"sys.path.insert(0, {str(tmp_path / 'src')!r})\n"
        "import pkg.two\n"
        "print(pkg.two.four(5), pkg.two.__file__.endswith('.py'))\n"
    )
    child = _child(code)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["20", "False"]
    files["pkg.two"].chmod(0o777)  # another user could have replaced it: not loaded
    with pytest.raises(NativeBuildError, match=r"could have been written by another user"):
        compiled.build(["pkg.one", "pkg.two"], told.append)


def test_a_build_that_does_not_load_leaves_the_sources_in_use(tmp_path: Path) -> None:
    # the group's last module is not a library: the sixteen before it and what they
    # imported of sendpath are dropped, numpy stays (it cannot load twice), and the run
    # is in Python
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from sendpath.sim import compiled\n"
        "files = compiled.build()\n"
        f"broken = Path({str(tmp_path)!r}) / 'simulator.so'\n"
        "broken.write_bytes(b'not a library')\n"
        "compiled.build = lambda *a: {**files, 'sendpath.sim.simulator': broken}\n"
        "print(compiled.use())\n"
        "import numpy, sendpath.clock, sendpath.sim.simulator as s\n"
        "from sendpath.sim.compiled import GROUP\n"
        "print(all(sys.modules[m].__file__.endswith('.py') for m in GROUP))\n"
        "from sendpath.request import Request\n"
        "print(s.Request is Request)\n"
    )
    child = _child(code, SENDPATH_SIM_COMPILED="1")
    assert child.returncode == 0, child.stderr[-2000:]
    said, sources, same = child.stdout.splitlines()
    assert said.startswith("in Python (the compiled modules do not load: ")
    assert sources == "True" and same == "True"


def test_a_build_cut_short_by_its_time_limit_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiled, "ROOT", tmp_path / "src")
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "BUILD_TIMEOUT_S", 0.01)
    _tree(tmp_path / "src", {"pkg.one": "X = 1\n"})
    with pytest.raises(NativeBuildError, match=r"mypyc took over 0\.01 s"):
        compiled.build(["pkg.one"])
    assert list((tmp_path / "cache" / "mypyc").iterdir()) == []  # nothing kept, nothing barred
