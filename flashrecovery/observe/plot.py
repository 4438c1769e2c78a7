"""Draw a job's timeline (observe/timeline.py) as a PNG with matplotlib, off-screen."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from flashrecovery.connectors.base import LogConnector
from flashrecovery.engine.replay import ReplayReport, replay_job
from flashrecovery.observe.timeline import Timeline, build
from flashrecovery.records import Stream
from flashrecovery.statemachines.incident import PHASES

matplotlib.use("Agg")  # files only, never a window
from matplotlib import pyplot as plt  # after use("Agg"): the backend must be chosen first
from matplotlib.patches import Patch

PHASE_COLOURS: dict[str, str] = dict(
    zip(PHASES, ["#d62728", "#ff7f0e", "#bcbd22", "#2ca02c", "#1f77b4", "#9467bd"], strict=True)
)
KIND_COLOURS = {"spare": "#9ecae1", "lease": "#c7e9c0", "heard": "#eeeeee"}
LANE_HEIGHT = 0.6


def render(line: Timeline, path: Path) -> Path:
    """Write the picture; lanes top to bottom, seconds since the job started along x."""
    rows = {lane: len(line.lanes) - 1 - i for i, lane in enumerate(line.lanes)}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.45 * len(line.lanes)))
    for span in line.spans:
        y = rows[span.lane]
        colour = PHASE_COLOURS.get(span.kind) or KIND_COLOURS.get(span.kind, "#cccccc")
        width = max(span.end - span.start, line.end / 2000)  # a 1 ms phase stays visible
        ax.broken_barh([(span.start, width)], (y - LANE_HEIGHT / 2, LANE_HEIGHT), color=colour)
        if span.kind in PHASE_COLOURS:
            continue  # labelled in the incident's caption below
        ax.text(span.start, y, f" {span.label}", va="center", fontsize=7, clip_on=True)
    commits = [m for m in line.marks if m.kind == "commit"]
    ax.scatter(
        [m.at for m in commits],
        [rows[m.lane] for m in commits],
        marker="|",
        s=60,
        color="#444444",
        linewidths=0.8,
        label="committed step",
    )
    for mark in (m for m in line.marks if m.kind != "commit"):
        fault = mark.kind == "fault"
        ax.scatter(
            [mark.at],
            [rows[mark.lane]],
            marker="X" if fault else "v",
            s=80 if fault else 40,
            color="#d62728" if fault else "#ff7f0e",
            zorder=3,
        )
        ax.annotate(
            mark.label,
            (mark.at, rows[mark.lane] + LANE_HEIGHT / 2),
            fontsize=7,
            color="#d62728" if fault else "#a65500",
            ha="center",
            va="bottom",
        )
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_ylim(-0.8, len(line.lanes) - 0.2)
    ax.set_xlim(0, max(line.end, 1e-3) * 1.01)
    ax.set_xlabel("seconds since the job started")
    ax.set_title(f"job {line.job_id}: {_caption(line)}", fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)
    shown = [p for p in PHASES if any(s.kind == p for s in line.spans)]
    handles = [Patch(color=PHASE_COLOURS[p], label=p) for p in shown]
    handles += [Patch(color=KIND_COLOURS["spare"], label="hot spare ready")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _caption(line: Timeline) -> str:
    """Each incident's phases with their durations, in words."""
    incidents: dict[str, list[str]] = {}
    for span in line.spans:
        if span.kind in PHASE_COLOURS:
            incident, phase, ms, _ = span.label.rsplit(" ", 3)
            incidents.setdefault(incident, []).append(f"{phase} {ms} ms")
    if not incidents:
        return "no incident"
    return "\n".join(f"{i}: " + ", ".join(parts) for i, parts in incidents.items())


def plot_job(
    log: LogConnector, job_id: str, path: Path, report: ReplayReport | None = None
) -> Path:
    """Replay the job (unless already replayed) and draw its timeline to ``path``."""
    report = report or replay_job(log, job_id)
    return render(build(log.read(Stream.EVENTS, job_id), report), path)
