"""The sendpath command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sendpath import __version__
from sendpath.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sendpath.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_subcommands() -> None:
    res = run("--help")
    assert res.returncode == 0
    assert "usage: sendpath" in res.stdout
    assert "generate" in res.stdout and "version" in res.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"sendpath {__version__}"


def test_generate_streams_an_answer() -> None:
    res = run("generate", "What is the capital of Japan?", "--max-tokens", "20")
    assert res.returncode == 0, res.stderr
    assert "Tokyo" in res.stdout


def test_generate_reports_errors_clearly() -> None:
    res = run("generate", "hi", "--model", "/does/not/exist.gguf")
    assert res.returncode == 2
    assert "error: Model path '/does/not/exist.gguf' does not exist" in res.stderr
    res = run("generate", "hi", "--temperature", "-1")
    assert res.returncode == 2
    assert "temperature must be >= 0" in res.stderr
