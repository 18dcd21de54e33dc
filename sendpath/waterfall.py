"""The terminal waterfall of one request: each stage's bar where it happened, its
milliseconds and its share of what the client waited, network included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["Row", "draw", "rows"]

WIDTH = 40
_STYLE = {"gateway": "cyan", "route": "blue", "network": "magenta", "decode": "green"}


@dataclass(frozen=True)
class Row:
    stage: str
    ms: float
    share: float  # of the client's total
    bar: str  # WIDTH characters: where in the request this stage happened


def rows(stages: list[dict[str, Any]], network_ms: float | None) -> list[Row]:
    """Rows for the server's stages (start_ms, duration_ms) and the network: half of it
    before the server saw the request and half after its last byte, as far as a client
    can tell (it sees only their sum)."""
    net = max(0.0, network_ms or 0.0)
    server = max((s["start_ms"] + s["duration_ms"] for s in stages), default=0.0)
    total = server + net
    scale = WIDTH / total if total > 0 else 0.0

    def bar(spans: list[tuple[float, float]]) -> str:
        cells = [" "] * WIDTH
        for start, dur in spans:
            a = min(WIDTH - 1, int(start * scale))
            b = max(a + 1, min(WIDTH, round((start + dur) * scale)))
            for i in range(a, b):
                cells[i] = "█"
        return "".join(cells)

    out = [
        Row(s["stage"], s["duration_ms"], s["duration_ms"] / total if total else 0.0,
            bar([(net / 2 + s["start_ms"], s["duration_ms"])]))
        for s in stages
    ]  # fmt: skip
    if network_ms is not None:
        out.append(Row("network", net, net / total if total else 0.0,
                       bar([(0.0, net / 2), (net / 2 + server, net / 2)])))  # fmt: skip
    return out


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
