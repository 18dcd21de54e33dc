"""The sendpath command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    assert "temperature must be a finite number >= 0" in res.stderr


def test_keys_commands(tmp_path: Path) -> None:
    base = ["keys", "--data-dir", str(tmp_path)]
    res = run(*base, "create", "--name", "alice", "--tpm", "1000")
    assert res.returncode == 0
    secret = res.stdout.strip().splitlines()[-1]
    assert secret.startswith("sk-sp-")
    listed = run(*base, "list").stdout
    assert "alice" in listed and "1000" in listed and secret not in listed
    dup = run(*base, "create", "--name", "alice")
    assert dup.returncode == 2 and "already exists" in dup.stderr
    assert run(*base, "revoke", "alice").returncode == 0
    assert "revoked" in run(*base, "list").stdout
    assert run(*base, "usage").returncode == 0
    # --data-dir after the action works too, and reads the same keys
    after = run("keys", "list", "--data-dir", str(tmp_path))
    assert after.returncode == 0 and "alice" in after.stdout
    made = run("keys", "create", "--name", "bob", "--data-dir", str(tmp_path))
    assert made.returncode == 0 and "bob" in run(*base, "list").stdout


def test_replica_refuses_a_missing_model_path() -> None:
    res = run("replica", "--model", "/does/not/exist.gguf", "--port", "1")
    assert res.returncode == 2
    assert "model path '/does/not/exist.gguf' does not exist" in res.stderr
    bad = run("replica", "--max-num-seqs", "0")
    assert bad.returncode == 2 and "max_num_seqs must be >= 1" in bad.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["keys", "--help"]])
def test_help_and_version_load_neither_torch_nor_the_simulator(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from sendpath.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('torch', 'scipy', 'fastapi', 'sendpath.sim', 'sendpath.engine.core')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy\n"
        "             or m.startswith('sendpath.sim')), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stderr.strip() == "[]"
    assert "sendpath" in done.stdout
