"""Where results go and how they are shown: the JSON, the machine they ran on, a table, a
figure, a stacked-bar plot."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import matplotlib
import torch
from rich.table import Table

matplotlib.use("Agg")  # files only, never a window
from matplotlib import pyplot as plt  # after use("Agg"): the backend must be chosen first
from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parent.parent / "results"


def machine() -> dict[str, Any]:
    """Where the numbers come from; the load average tells whether others shared the cores."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1_5_15m": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    out = Table(title=title)
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds in a table cell ("-" for none)."""
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def save_figure(fig: Figure, path: Path) -> Path:
    """Lay out, write and close a figure: the last step of every bench's plot."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def stacked_bars(
    name: str, title: str, ylabel: str, labels: list[str], stacks: dict[str, list[float]]
) -> Path:
    """One bar per label, one segment per stack (in order): parts that add up to a whole."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(labels) + 2), 4.5))
    bottom = [0.0] * len(labels)
    for segment, values in stacks.items():
        ax.bar(labels, values, bottom=bottom, label=segment)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.0f}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
