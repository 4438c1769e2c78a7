"""Human-readable rendering of a replay: verdict, machines, incidents with their phases."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashrecovery import terminal
from flashrecovery.connectors.signing import SECRET
from flashrecovery.replay.replayer import ReplayReport
from flashrecovery.replay.verify import ChainReport
from flashrecovery.replay.whatif import Comparison


def print_replay(report: ReplayReport, console: Console | None = None) -> None:
    """Record text (job ids, reasons) is printed as it is, never read as markup."""
    console = console or terminal.console()
    data = report.to_json()
    verdict = (
        "[green]replay OK[/]"
        if report.ok
        else "[red]DIVERGENCE[/]"
        if report.divergence is not None
        else "[red]INCONSISTENT[/]"
    )
    console.print(
        f"{verdict}  job {escape(report.job_id)}: {report.events} events, "
        f"{report.decisions_checked} decisions reproduced, generation {report.state.generation}, "
        f"job {report.state.job.state}"
    )
    if report.divergence is not None:
        console.print(report.divergence.describe(), markup=False)
    for problem in report.unleased_deciders:
        console.print(f"decided without the lease: {problem}", markup=False)
    for problem in report.double_commits:
        console.print(f"two generations committed a step: {problem}", markup=False)
    for problem in report.believed_from_lost_nodes:
        console.print(f"believed from a node given up: {problem}", markup=False)
    for problem in report.forged_decisions:
        console.print(f"a decision no engine signed, not believed: {problem}", markup=False)
    if report.state.verdict is not None:
        console.print(f"the engine failed the job: {report.state.verdict}", markup=False)
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
    for inc in data["incidents"]:
        fallback = inc["checkpoint_step"] is not None
        source = " from the checkpoint, no replica being left" if fallback else ""
        console.print(
            f"[bold]{escape(inc['incident_id'])}[/]: {inc['failed']}, "
            f"{escape(inc['reason'])} "
            f"-> {inc['state']} (generation {inc['generation']}, resumed after step "
            f"{inc['resume_step']}{source})",
            highlight=False,
        )
        phases = Table(show_header=True)
        phases.add_column("phase")
        phases.add_column("ms", justify="right")
        for phase, seconds in inc["phases_s"].items():
            phases.add_row(phase, f"{seconds * 1000:.1f}")
        console.print(phases)
        if inc["rto_s"] is not None:
            console.print(
                f"RTO {inc['rto_s'] * 1000:.1f} ms, committed steps lost {inc['rpo_steps']}, "
                f"steps recomputed {inc['recomputed_steps']}"
            )


def print_chain(report: ChainReport, console: Console | None = None) -> None:
    console = console or terminal.console()
    seal = (
        f"sealed at events position {report.seal_position} (seal hash {report.seal_hash})"
        if report.sealed
        else "not sealed (no final record names the chain heads)"
    )
    verdict = "[green]chain OK[/]" if report.ok else "[red]CHAIN BROKEN[/]"
    console.print(
        f"{verdict}: {report.records} records, {report.writers} writers, {seal}", highlight=False
    )
    if report.unchained:
        console.print(f"{report.unchained} record(s) carry no chain link (older or foreign)")
    if report.after_seal:
        console.print(f"{report.after_seal} event(s) after the seal are not covered by it")
    checked = (
        "each checked with the job's secret"
        if report.signatures_checked
        else f"not checked: give the job's secret in {SECRET} to check them"
    )
    console.print(f"{report.signed} record(s) signed, {checked}", highlight=False)
    if report.first is not None:
        console.print(
            f"first break: {report.first.describe()} ({len(report.breaks)} in all)",
            markup=False,
            highlight=False,
        )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_what_if(comparison: Comparison, console: Console | None = None) -> None:
    """The recorded run and the what-if run side by side: decisions, then incidents."""
    console = console or terminal.console()
    changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in comparison.changed.items())
    console.print(f"[bold]what if[/] {changes or 'nothing changed'}", highlight=False)
    if comparison.exact:
        console.print("the what-if run makes exactly the recorded decisions")
    decisions = Table(title="decisions (s since the job started)")
    for column in ("#", "recorded at", "recorded", "", "what-if at", "what-if"):
        decisions.add_column(column)
    for i, row in enumerate(comparison.decision_rows()):
        decisions.add_row(
            str(i),
            _seconds(row["recorded_at_s"]),
            escape(row["recorded"] or "-"),
            "" if row["same"] else "[red]≠[/]",
            _seconds(row["what_if_at_s"]),
            escape(row["what_if"] or "-"),
        )
    console.print(decisions)
    incidents = Table(title="incidents (s)")
    for column in ("rank", "cause", "detected at", "detection", "RTO", "note"):
        incidents.add_column(column)
    for row in comparison.incident_rows():
        incidents.add_row(
            str(row["failed_rank"]),
            f"{row['recorded_cause'] or '-'} / {row['what_if_cause'] or '-'}",
            f"{_seconds(row['recorded_detected_at_s'])} / {_seconds(row['what_if_detected_at_s'])}",
            f"{_seconds(row['recorded_detection_s'])} / {_seconds(row['what_if_detection_s'])}",
            f"{_seconds(row['recorded_rto_s'])} / {_seconds(row['what_if_rto_s'])}",
            escape(row["note"]),
        )
    console.print(incidents, "(each cell: recorded / what-if)")
