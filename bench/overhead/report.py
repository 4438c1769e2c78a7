"""The overhead's JSON, its tables and its plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.lib.results import RESULTS, plt, table, write_json
from bench.overhead.sides import SIDES
from bench.overhead.summary import GOAL_PCT


def plot(results: list[dict[str, Any]]) -> Path:
    """Per model and world, each side's median step (bar), p10-p90 (whisker), run medians
    (dots), and each hook side's overhead over its baseline."""
    fig, axes = plt.subplots(
        1, len(results), figsize=(max(6.5, 4.2 * len(results)), 4.5), squeeze=False
    )
    for ax, result in zip(axes[0], results, strict=True):
        names = list(result["sides"])
        for x, name in enumerate(names):
            s = result["sides"][name]
            ax.bar(x, s["median_ms"], color="tab:gray" if not SIDES[name].hook else "tab:blue")
            ax.errorbar(
                x,
                s["median_ms"],
                yerr=[[s["median_ms"] - s["p10_ms"]], [s["p90_ms"] - s["median_ms"]]],
                color="black",
                capsize=3,
            )
            ax.plot([x] * len(s["run_medians_ms"]), s["run_medians_ms"], "o", color="tab:orange")
            if "overhead_pct" in s:
                ax.annotate(
                    f"{s['overhead_pct']:+.1f}%",
                    (x, s["p90_ms"]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
        ax.set_title(f"{result['model']}, {result['world_size']} ranks", fontsize=9)
        ax.set_ylabel("ms per step")
    fig.suptitle(
        "step time: plain torch (gray) vs under the flashrecovery hook (blue)", fontsize=10
    )
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "overhead.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_pooled(console: Console, paths: list[Path], cells: list[dict[str, Any]]) -> None:
    """Write the pooled JSON and print its table."""
    path = write_json("overhead_pooled", {"pooled": [str(p) for p in paths], "cells": cells})
    rows = [
        [
            c["model"],
            str(c["world_size"]),
            c["side"],
            str(c["runs"]),
            str(len(c["pairs"])),
            overhead_text(c),
        ]
        for c in cells
    ]
    columns = [
        "model",
        "ranks",
        "side",
        "runs",
        "pairs",
        f"vs baseline (interval): <= {GOAL_PCT:.0f}%?",
    ]
    console.print(table(f"pooled over {len(paths)} runs", columns, rows))
    console.print(f"written {path}")


def report(console: Console, data: dict[str, Any]) -> None:
    """Write the JSON, print the table, draw the plot."""
    path = write_json("overhead", data)
    results = data["results"]
    loads = [
        load for r in results for run in r.get("runs", ()) for load in run["load_1m_before_after"]
    ]
    loads += [phase["load_1m"] for r in results for phase in r.get("phases", ())]
    console.print(overhead_table(results, min(loads), max(loads)))
    for r in results:
        if "phases" in r:
            base, hook = (r["sides"][n] for n in r["ranks"])
            console.print(
                f"{r['model']}, {r['world_size']} ranks, taking turns: while waiting, the hook's "
                f"job took {hook['waiting_cpu_ms_per_s']:.1f} ms of CPU a second, the "
                f"baseline's {base['waiting_cpu_ms_per_s']:.1f}; each paired overhead includes "
                f"{hook['waiting_bias_pct']:+.2f} % for the difference"
            )
    console.print(f"written {path} and {plot(results)}")


def overhead_text(s: dict[str, Any]) -> str:
    """A hook side's (or a pooled cell's) overhead, its interval and the verdict, in a cell."""
    interval = s["overhead_pct_interval"]
    return (
        f"{s['overhead_pct']:+.1f}% "
        f"({interval['low']:+.1f}…{interval['high']:+.1f} {interval['coverage']:.0%}) "
        f"{s['within_goal']}"
    )


def overhead_table(results: list[dict[str, Any]], load_min: float, load_max: float) -> Any:
    rows = []
    for r in results:
        for name, s in r["sides"].items():
            parts = s["parts_ms"]
            overhead = overhead_text(s) if "overhead_pct" in s else ""
            rows.append(
                [
                    r["model"],
                    str(r["world_size"]),
                    name,
                    f"{s['median_ms']:.1f}",
                    f"{s['p10_ms']:.1f}-{s['p90_ms']:.1f}",
                    f"{parts['compute']:.1f} / {parts['commit']:.2f} / {parts['optimizer']:.1f}",
                    f"{parts['cpu']:.1f} / {parts['agent_cpu']:.1f}",
                    overhead,
                    f"{s['job_cpu_overhead_pct']:+.1f}%" if "job_cpu_overhead_pct" in s else "",
                ]
            )
    return table(
        f"ms per step, steady state, every rank's steps; 1-min load {load_min:.1f}-{load_max:.1f}"
        f" on {os.cpu_count()} cores",
        [
            "model",
            "ranks",
            "side",
            "median",
            "p10-p90",
            "fwd+bwd / commit / opt",
            "CPU rank / agent",
            f"vs baseline (interval): <= {GOAL_PCT:.0f}%?",
            "job CPU vs baseline",
        ],
        rows,
    )
