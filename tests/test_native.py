"""C extensions built on first use: built once into the cache folder and loaded; a
missing compiler or a source that does not compile is an error that says so."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

from sendpath.native import NativeBuildError, build_extension

SOURCE = """
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&module); }
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "native"


def test_an_extension_is_built_once_and_loaded(
    tmp_path: Path, cache: Path, native: ModuleType
) -> None:
    source = tmp_path / "tiny.c"
    source.write_text(SOURCE.replace("NAME", "_tiny"))
    assert build_extension("_tiny", source).answer() == 42
    (built,) = cache.iterdir()  # one file, no partial one left
    stamp = built.stat().st_mtime_ns
    assert build_extension("_tiny", source).answer() == 42
    assert built.stat().st_mtime_ns == stamp  # not built again
    source.write_text(SOURCE.replace("NAME", "_tiny").replace("42", "43"))
    assert build_extension("_tiny", source).answer() == 43  # an edit builds anew


def test_a_source_that_does_not_compile_says_where(
    tmp_path: Path, cache: Path, native: ModuleType
) -> None:
    source = tmp_path / "broken.c"
    source.write_text("#include <Python.h>\nthis is not C;\n")
    with pytest.raises(NativeBuildError, match=r"failed on broken\.c: .*error"):
        build_extension("_broken", source)
    assert not cache.exists() or not list(cache.iterdir())  # nothing half-built kept


def test_no_compiler_is_an_error_that_names_it(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, native: ModuleType
) -> None:
    source = tmp_path / "tiny.c"
    source.write_text(SOURCE.replace("NAME", "_tiny"))
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: "/no/such/cc" if name == "CC" else real(name)
    )
    with pytest.raises(NativeBuildError, match=r"no C compiler: /no/such/cc is not found"):
        build_extension("_tiny", source)


def test_a_built_file_that_does_not_load_is_built_again(
    tmp_path: Path, cache: Path, native: ModuleType
) -> None:
    source = tmp_path / "tiny.c"
    source.write_text(SOURCE.replace("NAME", "_cut"))
    build = (
        "from pathlib import Path; from sendpath.native import build_extension as b; "
        f"b('_cut', Path({str(source)!r}))"
    )
    subprocess.run([sys.executable, "-c", build], check=True)  # built, never loaded here
    (built,) = cache.iterdir()
    built.write_bytes(built.read_bytes()[:100])  # cut short
    assert build_extension("_cut", source).answer() == 42
    assert built.stat().st_mode & 0o044 == 0o044  # others sharing the cache can read it


def test_a_cache_folder_that_cannot_be_written_is_an_error_that_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: ModuleType
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(blocker))
    source = tmp_path / "tiny.c"
    source.write_text(SOURCE.replace("NAME", "_tiny"))
    with pytest.raises(NativeBuildError, match=r"cannot keep a built tiny\.c"):
        build_extension("_tiny", source)


def test_a_built_file_another_user_could_have_written_is_not_loaded(
    tmp_path: Path, cache: Path, native: ModuleType
) -> None:
    source = tmp_path / "own.c"
    source.write_text(SOURCE.replace("NAME", "_own"))
    umask = os.umask(0o002)  # a user whose files are group-writable: the build is not
    try:
        assert build_extension("_own", source).answer() == 42
    finally:
        os.umask(umask)
    (built,) = cache.iterdir()
    assert cache.stat().st_mode & 0o022 == 0 and built.stat().st_mode & 0o022 == 0
    built.chmod(0o777)
    with pytest.raises(NativeBuildError, match=r"own.*could have been written by another "
                       r"user: not loaded \(delete it to rebuild\)"):  # fmt: skip
        build_extension("_own", source)
    built.chmod(0o755)
    cache.chmod(0o777)  # the folder: anyone could have swapped the file
    with pytest.raises(NativeBuildError, match=r"native could have been written by another"):
        build_extension("_own", source)


def test_a_file_writable_by_the_users_own_group_is_loaded(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, native: ModuleType
) -> None:
    source = tmp_path / "group.c"
    source.write_text(SOURCE.replace("NAME", "_group"))
    assert build_extension("_group", source).answer() == 42
    (built,) = cache.iterdir()
    built.chmod(0o775)  # as a umask of 002 leaves a file (an older build, say)
    monkeypatch.setattr("sendpath.native._own_group", lambda gid: True)  # a private group
    assert build_extension("_group", source).answer() == 42
    monkeypatch.setattr("sendpath.native._own_group", lambda gid: False)  # a shared one
    with pytest.raises(NativeBuildError, match=r"could have been written by another user"):
        build_extension("_group", source)
