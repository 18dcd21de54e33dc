"""The stage breakdown of a benchmark report as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_stages"]


def plot_stages(report: dict[str, Any], path: Path) -> None:
    """One horizontal bar: each stage's mean milliseconds, in path order, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = report.get("stages") or {}
    fig, ax = plt.subplots(figsize=(10, 2.6))
    left = 0.0
    cmap = plt.get_cmap("tab20")
    for i, (name, v) in enumerate(stages.items()):
        width = v["mean_ms"]
        ax.barh(0, width, left=left, color=cmap(i % 20), label=f"{name} {v['share']:.0%}")
        left += width
    ax.set_yticks([])
    ax.set_xlabel("milliseconds (mean per request)")
    title = report.get("scenario") or report.get("dataset") or "benchmark"
    ax.set_title(f"sendpath bench: {title} ({report.get('completed', 0)} requests)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
