"""Optional features without their extra: one line naming the extra, exit code 2, before
any work starts (no server is listening at the URLs below, and none is needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sendpath.cli import main
from sendpath.errors import MissingExtraError
from sendpath.extras import EXTRAS, require


def hide(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make ``import module`` fail as it does where the package is not installed."""
    monkeypatch.setitem(sys.modules, module, None)


def test_require_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    require("plot")  # installed here: nothing happens
    hide(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtraError) as info:
        require("plot")
    assert info.value.message == "--plot needs matplotlib: pip install 'sendpath[plot]'"
    assert set(EXTRAS) == {"plot", "redis", "kv-events", "ray", "otel"}


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("matplotlib", ["bench", "--model", "m", "--plot", "{tmp}/s.png"],
         "error: --plot needs matplotlib: pip install 'sendpath[plot]'"),
        ("matplotlib", ["sim", "--requests", "5", "--plot", "{tmp}/s.png"],
         "error: --plot needs matplotlib: pip install 'sendpath[plot]'"),
        ("redis", ["gateway", "--replica", "http://127.0.0.1:9", "--redis", "redis://x:1"],
         "error: --redis needs redis: pip install 'sendpath[redis]'"),
        ("redis", ["serve", "--replicas", "1", "--redis", "redis://x:1"],
         "error: --redis needs redis: pip install 'sendpath[redis]'"),
        ("zmq", ["replica", "--kv-events-config", '{"enable_kv_cache_events": true}'],
         "error: --kv-events-config needs pyzmq and msgpack: pip install 'sendpath[kv-events]'"),
        ("msgpack", ["serve", "--kv-events-config", '{"enable_kv_cache_events": true}'],
         "error: --kv-events-config needs pyzmq and msgpack: pip install 'sendpath[kv-events]'"),
        ("ray.serve", ["serve", "--ray", "auto"],
         "error: --ray needs Ray Serve: pip install 'sendpath[ray]'"),
        ("ray.serve", ["gateway", "--ray", "127.0.0.1:6379"],
         "error: --ray needs Ray Serve: pip install 'sendpath[ray]'"),
        *[
            ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
             [*command, "--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces"],
             "error: --otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP "
             "exporter: pip install 'sendpath[otel]'")
            for command in (["gateway", "--replica", "http://127.0.0.1:9"], ["replica"],
                            ["serve", "--replicas", "1"])
        ],
    ],
)  # fmt: skip
def test_cli_refuses_a_flag_whose_extra_is_missing(
    module: str,
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hide(monkeypatch, module)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == message
    assert "Traceback" not in captured.err and not list(tmp_path.iterdir())
