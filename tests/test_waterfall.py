"""The terminal waterfall: bars where each stage happened, shares of the client's total."""

from __future__ import annotations

import io

from rich.console import Console

from sendpath.waterfall import WIDTH, draw, rows

STAGES = [
    {"stage": "gateway.auth", "start_ms": 0.0, "duration_ms": 10.0},
    {"stage": "prefill", "start_ms": 10.0, "duration_ms": 30.0},
    {"stage": "decode", "start_ms": 40.0, "duration_ms": 40.0},
]


def test_rows_place_stages_and_split_network_around_the_server() -> None:
    out = rows(STAGES, network_ms=20.0)  # client total 100 ms
    assert [r.stage for r in out] == ["gateway.auth", "prefill", "decode", "network"]
    assert [round(r.share, 2) for r in out] == [0.1, 0.3, 0.4, 0.2]
    scale = WIDTH / 100
    auth, prefill, decode, network = (r.bar for r in out)
    assert auth.index("█") == int(10 * scale)  # after the first half of the network
    assert prefill.index("█") == int(20 * scale) and decode.rstrip().endswith("█")
    assert network.startswith("█") and network.endswith("█") and " " in network
    assert all(len(r.bar) == WIDTH for r in out)


def test_without_network_and_drawn() -> None:
    assert [r.stage for r in rows(STAGES, None)] == ["gateway.auth", "prefill", "decode"]
    buf = io.StringIO()
    draw(STAGES, 20.0, Console(file=buf, width=100))
    text = buf.getvalue()
    assert "prefill" in text and "30.0" in text and "network" in text and "100%" in text
