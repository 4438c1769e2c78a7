"""Human-readable rendering of a replay: verdict, machines, incidents with their phases."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from flashrecovery.engine.replay import ReplayReport


def print_replay(report: ReplayReport, console: Console | None = None) -> None:
    console = console or Console()
    data = report.to_json()
    verdict = "[green]replay OK[/]" if report.ok else "[red]DIVERGENCE[/]"
    console.print(
        f"{verdict}  job {report.job_id}: {report.events} events, "
        f"{report.decisions_checked} decisions reproduced, generation {report.state.generation}, "
        f"job {report.state.job.state}"
    )
    if report.divergence is not None:
        console.print(report.divergence.describe(), markup=False)
    if report.pending:
        console.print(
            f"{len(report.pending)} decision(s) due but not yet in the log (engine stopped?)"
        )
    if data["rejected"]:
        console.print(f"rejected records: {json.dumps(data['rejected'])}", markup=False)
    if report.state.fenced:
        console.print(f"records fenced (stale generation or process): {report.state.fenced}")
    ranks = Table(title="ranks")
    ranks.add_column("rank")
    ranks.add_column("state")
    ranks.add_column("pid")
    ranks.add_column("committed step")
    for rank, view in sorted(report.state.ranks.items()):
        ranks.add_row(str(rank), view.machine.state, str(view.pid), str(view.committed_step))
    console.print(ranks)
    if not data["incidents"]:
        console.print("no incidents")
        return
    incidents = Table(title="incidents")
    for column in (
        "incident",
        "rank",
        "reason",
        "state",
        "phases (ms)",
        "RTO (s)",
        "lost",
        "redone",
    ):
        incidents.add_column(column)
    for inc in data["incidents"]:
        phases = ", ".join(f"{k} {v * 1000:.0f}" for k, v in inc["phases_s"].items())
        incidents.add_row(
            inc["incident_id"],
            str(inc["failed_rank"]),
            inc["reason"],
            inc["state"],
            phases,
            "-" if inc["rto_s"] is None else f"{inc['rto_s']:.3f}",
            "-" if inc["rpo_steps"] is None else str(inc["rpo_steps"]),
            "-" if inc["recomputed_steps"] is None else str(inc["recomputed_steps"]),
        )
    console.print(incidents)
