"""Where the built kernels are kept: a folder or module another user could write is not
loaded, and what a build makes, nobody else can write."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from torch.utils import cpp_extension

from sendpath.model import kernels


def test_a_kernel_folder_another_user_could_write_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(tmp_path))
    target = kernels.kernel_dir()
    target.mkdir(parents=True)
    target.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="sendpath.model.kernels"):
        assert kernels._build() is None  # refused before any build
    assert "could have been written by another user: not loaded" in caplog.text
    assert "uses its torch paths" in caplog.text
    assert list(target.iterdir()) == []


def test_a_built_module_another_user_could_write_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(tmp_path))
    target = kernels.kernel_dir()
    target.mkdir(parents=True, mode=0o755)
    planted = target / "sendpath_cpu_kernels.so"
    planted.write_bytes(b"not a module")
    planted.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="sendpath.model.kernels"):
        assert kernels._build() is None
    assert f"{planted} could have been written by another user" in caplog.text


def test_what_the_build_makes_nobody_else_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SENDPATH_CACHE_DIR", str(tmp_path))
    seen: list[int] = []

    def load(**kwargs: Any) -> str:  # torch's builder, as far as the umask goes
        umask = os.umask(0)
        os.umask(umask)
        seen.append(umask)
        return "the module"

    monkeypatch.setattr(cpp_extension, "load", load)
    before = os.umask(0o002)  # a user whose files are group-writable
    try:
        assert kernels._build() == "the module"
        assert os.umask(0o002) == 0o002  # given back
    finally:
        os.umask(before)
    assert seen == [0o022]
    assert kernels.kernel_dir().stat().st_mode & 0o777 == 0o755
