"""The terminal waterfall of one request: each stage's bar where it happened, its
milliseconds and its share of what the client waited, network included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["Row", "draw", "rows", "with_network"]

WIDTH = 40
_STYLE = {"gateway": "cyan", "route": "blue", "network": "magenta", "decode": "green"}


@dataclass(frozen=True)
class Row:
    stage: str
    ms: float
    share: float  # of the client's total
    bar: str  # WIDTH characters: where in the request this stage happened


def with_network(stages: list[dict[str, Any]], network_ms: float | None) -> list[dict[str, Any]]:
    """The server's stages (start_ms, duration_ms) and the network as one more stage, laid
    out as a client sees them: half of the network before the server saw the request (the
    server's stages start after it) and half after its last byte (the network's ``spans``),
    as far as a client can tell (it sees only their sum). No network: the stages as they
    are."""
    if network_ms is None:
        return list(stages)
    net = max(0.0, network_ms)
    server = max((s["start_ms"] + s["duration_ms"] for s in stages), default=0.0)
    shifted = [{**s, "start_ms": s["start_ms"] + net / 2} for s in stages]
    spans = [[0.0, net / 2], [net / 2 + server, net / 2]]
    return [*shifted, {"stage": "network", "start_ms": 0.0, "duration_ms": net, "spans": spans}]


def rows(stages: list[dict[str, Any]], network_ms: float | None) -> list[Row]:
    """One row per stage of ``with_network``: its bar where it happened, its share."""
    laid = with_network(stages, network_ms)
    total = max((s["start_ms"] + s["duration_ms"] for s in stages), default=0.0)
    total += max(0.0, network_ms or 0.0)
    scale = WIDTH / total if total > 0 else 0.0

    def bar(spans: list[list[float]]) -> str:
        cells = [" "] * WIDTH
        for start, dur in spans:
            a = min(WIDTH - 1, int(start * scale))
            b = max(a + 1, min(WIDTH, round((start + dur) * scale)))
            for i in range(a, b):
                cells[i] = "█"
        return "".join(cells)

    return [
        Row(s["stage"], s["duration_ms"], s["duration_ms"] / total if total else 0.0,
            bar(s.get("spans") or [[s["start_ms"], s["duration_ms"]]]))
        for s in laid
    ]  # fmt: skip


def draw(
    stages: list[dict[str, Any]],
    network_ms: float | None,
    console: Console,
    title: str = "where the time went",
) -> None:
    """Print the waterfall table."""
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1))
    table.add_column("stage", no_wrap=True, min_width=17)
    table.add_column("ms", justify="right", no_wrap=True, min_width=7)
    table.add_column("share", justify="right", no_wrap=True, min_width=6)
    table.add_column("timeline", no_wrap=True, min_width=WIDTH)
    all_rows = rows(stages, network_ms)
    for row in all_rows:
        style = _STYLE.get(row.stage.split(".")[0], "yellow")
        table.add_row(row.stage, f"{row.ms:.1f}", f"{row.share:.1%}", Text(row.bar, style=style))
    total = sum(r.ms for r in all_rows)
    table.add_row("total", f"{total:.1f}", "100%", "", style="bold")
    console.print(table)
