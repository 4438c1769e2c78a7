"""Draw a job's timeline (replay/timeline.py) as a PNG with matplotlib, off-screen."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

from flashrecovery.connectors.base import LogConnector
from flashrecovery.errors import ConfigError
from flashrecovery.records import Stream
from flashrecovery.replay.replayer import ReplayReport, replay_job
from flashrecovery.replay.timeline import Timeline, build
from flashrecovery.statemachines.incident import PHASES

matplotlib.use("Agg")  # files only, never a window
from matplotlib import pyplot as plt  # after use("Agg"): the backend must be chosen first
from matplotlib.axes import Axes
from matplotlib.patches import Patch

PHASE_COLOURS: dict[str, str] = dict(
    zip(PHASES, ["#d62728", "#ff7f0e", "#bcbd22", "#2ca02c", "#1f77b4", "#9467bd"], strict=True)
)
KIND_COLOURS = {"spare": "#9ecae1", "lease": "#c7e9c0", "heard": "#eeeeee"}
LANE_HEIGHT = 0.6
LABEL_GAP = 0.06  # of the window's width: labels closer than this on one lane would overlap
# kind -> marker, size, colour, label colour
MARK_STYLES = {
    "fault": ("X", 80, "#d62728", "#d62728"),
    "symptom": ("v", 40, "#ff7f0e", "#a65500"),
    "takeover": (">", 40, "#2c7fb8", "#2c7fb8"),
}


ZOOMED = 3  # incidents drawn again below, zoomed in on their phases
ZOOM_PAD = 0.5  # fraction of an incident's length shown before and after it


def render(line: Timeline, path: Path) -> Path:
    """Write the picture: the whole job on top (lanes top to bottom, seconds since the job
    started along x), then each incident (up to ZOOMED) zoomed in on its phases."""
    incidents = list(line.incidents().items())[:ZOOMED]
    height = 1.2 + 0.45 * len(line.lanes)
    fig, axes = plt.subplots(
        1 + len(incidents), 1, figsize=(14, height * (1 + 0.8 * len(incidents))), squeeze=False
    )
    whole = axes[0][0]
    _draw(whole, line, 0.0, max(line.end, 1e-3) * 1.01, label_phases=False)
    whole.set_title(f"job {line.job_id}: {_caption(line)}", fontsize=9, loc="left")
    shown = [p for p in PHASES if any(s.kind == p for s in line.spans)]
    handles = [Patch(color=PHASE_COLOURS[p], label=p) for p in shown]
    handles += [Patch(color=KIND_COLOURS["spare"], label="hot spare ready")]
    whole.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for (incident, (start, end)), row in zip(incidents, axes[1:], strict=True):
        pad = max(end - start, 0.01) * ZOOM_PAD
        _draw(row[0], line, start - pad, end + pad, label_phases=True)
        row[0].set_title(f"{incident}, zoomed in", fontsize=9, loc="left")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # the CLI checked it exists already
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"cannot write the timeline to {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path


def _draw(ax: Axes, line: Timeline, x0: float, x1: float, *, label_phases: bool) -> None:
    """The lanes between x0 and x1 (seconds since the job started)."""
    rows = {lane: len(line.lanes) - 1 - i for i, lane in enumerate(line.lanes)}
    for span in line.spans:
        y = rows[span.lane]
        colour = PHASE_COLOURS.get(span.kind) or KIND_COLOURS.get(span.kind, "#cccccc")
        width = max(span.end - span.start, (x1 - x0) / 2000)  # a 1 ms phase stays visible
        ax.broken_barh([(span.start, width)], (y - LANE_HEIGHT / 2, LANE_HEIGHT), color=colour)
        if span.kind not in PHASE_COLOURS:
            ax.text(max(span.start, x0), y, f" {span.label}", va="center", fontsize=7, clip_on=True)
        elif label_phases and width >= (x1 - x0) * 0.05:  # wide enough to hold its duration
            ms = span.label.rsplit(" ", 2)[-2]
            ax.text(span.start + width / 2, y, f"{ms} ms", ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)  # fmt: skip
    if label_phases:  # every phase in the window with its duration, in its colour, beside the
        # lanes (over them it hid the commits' step numbers)
        phases = [s for s in line.spans if s.kind in PHASE_COLOURS and x0 <= s.start <= x1]
        for i, span in enumerate(phases):
            _, phase, ms, _ = span.label.rsplit(" ", 3)
            ax.text(1.01, 0.96 - i * 0.075, f"{phase} {ms} ms", transform=ax.transAxes,
                    ha="left", va="top", fontsize=7, color=PHASE_COLOURS[span.kind])  # fmt: skip
    commits = [m for m in line.marks if m.kind == "commit" and x0 <= m.at <= x1]
    ax.scatter([m.at for m in commits], [rows[m.lane] for m in commits], marker="|", s=60,
               color="#444444", linewidths=0.8)  # fmt: skip
    if label_phases:  # below the lane: the phases' durations are written inside it
        for mark in commits:
            ax.annotate(mark.label, (mark.at, rows[mark.lane] - LANE_HEIGHT / 2), fontsize=6,
                        ha="center", va="top")  # fmt: skip
    last_label: dict[str, float] = {}  # lane -> where its last label above it was
    for mark in (m for m in line.marks if m.kind != "commit" and x0 <= m.at <= x1):
        marker, size, colour, text = MARK_STYLES[mark.kind]
        ax.scatter([mark.at], [rows[mark.lane]], marker=marker, s=size, color=colour, zorder=3)
        # Two labels close on one lane ("silent 3.0s", then "signal 9" as the rank is
        # isolated): the second goes below the lane, never over the first.
        crowded = mark.at - last_label.get(mark.lane, -math.inf) < (x1 - x0) * LABEL_GAP
        label_y = rows[mark.lane] + (-1 if crowded else 1) * LANE_HEIGHT / 2
        ax.annotate(mark.label, (mark.at, label_y), fontsize=7, color=text, ha="center",
                    va="top" if crowded else "bottom")  # fmt: skip
        if not crowded:
            last_label[mark.lane] = mark.at
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_ylim(-0.8, len(line.lanes) - 0.2)
    ax.set_xlim(x0, x1)
    ax.set_xlabel("seconds since the job started")
    ax.grid(axis="x", alpha=0.3)


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
