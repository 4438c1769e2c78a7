"""Replay a job's log through the machines and check every recorded decision.

`flashrecovery replay --log URL --job ID [--until POSITION] [--json] [--verify-chain]`: rebuild
the state from the events, recompute the decisions each event causes, compare them with what the
log recorded, and stop at the first divergence showing both records. Then tell the job's
incidents: each phase's duration, the RTO and the steps lost. ``--verify-chain`` also checks the
records' hash chains (flashrecovery/chain.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashrecovery.chain import read_streams
from flashrecovery.chain import verify as verify_chains
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import LogConnector
from flashrecovery.engine.ingest import ingest
from flashrecovery.engine.recovery import phase_durations
from flashrecovery.engine.state import EngineState
from flashrecovery.errors import ConfigError, LogError
from flashrecovery.records import Decision, IncidentClosed, Stream


@dataclass
class Divergence:
    position: int  # events position whose decisions differ
    recorded: dict[str, Any] | None  # None: the engine decides something the log lacks
    replayed: dict[str, Any] | None  # None: the log holds a decision replay does not make

    def describe(self) -> str:
        return (
            f"divergence at events position {self.position}:\n"
            f"  recorded: {json.dumps(self.recorded, sort_keys=True)}\n"
            f"  replayed: {json.dumps(self.replayed, sort_keys=True)}"
        )


@dataclass
class ReplayReport:
    job_id: str
    state: EngineState
    events: int = 0
    decisions_checked: int = 0
    divergence: Divergence | None = None
    pending: list[dict[str, Any]] = field(default_factory=list)  # decided, not yet recorded
    recorded_closures: list[Decision] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def incidents(self) -> list[dict[str, Any]]:
        closed = {d.incident_id: d for d in self.recorded_closures if isinstance(d, IncidentClosed)}
        out = []
        for incident in self.state.incidents:
            close = closed.get(incident.incident_id)
            out.append(
                {
                    "incident_id": incident.incident_id,
                    "failed_rank": incident.failed_rank,
                    "state": incident.machine.state,
                    "reason": incident.reason,
                    "generation": incident.generation,
                    "phases_s": phase_durations(incident),
                    "rto_s": close.rto_s if close else None,
                    "rpo_steps": close.rpo_steps if close else None,
                    "recomputed_steps": close.recomputed_steps if close else None,
                    "resume_step": incident.resume_step,
                }
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "ok": self.ok,
            "events": self.events,
            "decisions_checked": self.decisions_checked,
            "divergence": None
            if self.divergence is None
            else {
                "position": self.divergence.position,
                "recorded": self.divergence.recorded,
                "replayed": self.divergence.replayed,
            },
            "pending": self.pending,
            "job_state": self.state.job.state,
            "generation": self.state.generation,
            "ranks": {r: v.machine.state for r, v in sorted(self.state.ranks.items())},
            "rejected": dict(self.state.rejected),
            "fenced": self.state.fenced,
            "incidents": self.incidents(),
        }


def _as_dict(decision: Decision | None) -> dict[str, Any] | None:
    return None if decision is None else decision.model_dump(mode="json")


def replay_job(log: LogConnector, job_id: str, until: int | None = None) -> ReplayReport:
    """Rebuild the job from its events (up to ``until`` inclusive) and check its decisions."""
    recorded: dict[int, list[Decision]] = {}
    for entry in log.read(Stream.DECISIONS, job_id):
        if isinstance(entry.record, Decision):
            recorded.setdefault(entry.record.caused_by, []).append(entry.record)
    last_recorded = max(recorded, default=-1)
    report = ReplayReport(job_id, EngineState(job_id))
    report.recorded_closures = [
        d for ds in recorded.values() for d in ds if d.type == "incident_closed"
    ]
    for entry in log.read(Stream.EVENTS, job_id):
        if until is not None and entry.position > until:
            break
        report.events += 1
        replayed = ingest(report.state, entry)
        expected = recorded.pop(entry.position, [])
        if not expected and replayed and entry.position > last_recorded:
            report.pending.extend(d.model_dump(mode="json") for d in replayed)
            continue
        for i in range(max(len(expected), len(replayed))):
            want = expected[i] if i < len(expected) else None
            got = replayed[i] if i < len(replayed) else None
            if want != got:
                report.divergence = Divergence(entry.position, _as_dict(want), _as_dict(got))
                return report
            report.decisions_checked += 1
    stray = [p for p in recorded if until is None or p <= until]
    if stray:
        position = min(stray)
        report.divergence = Divergence(position, _as_dict(recorded[position][0]), None)
    return report


# ------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, help="log URL, e.g. sqlite://runs/JOB/log.db")
    parser.add_argument("--job", required=True, help="job id")
    parser.add_argument("--until", type=int, default=None, help="stop after this events position")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="draw the job's timeline (a lane per rank, host, spare and the engine) to this file",
    )
    parser.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="decide again with this setting changed (repeatable): heartbeat_interval, "
        "missed_heartbeats, startup_grace, stall_factor, stall_floor, spares, max_replacements, "
        "max_incidents; shows where detections and decisions differ and the RTO they imply",
    )
    parser.add_argument(
        "--verify-chain",
        action="store_true",
        help="also check every writer's hash chain and the final record's seal; report the "
        "first break (position, writer)",
    )


def run(args: argparse.Namespace) -> int:
    from flashrecovery.engine.report import print_chain, print_replay, print_what_if
    from flashrecovery.observe.whatif import compare, parse_settings

    try:
        settings = parse_settings(args.what_if)
        with open_log(args.log, read_only=True) as log:
            if args.job not in log.jobs():
                raise LogError(f"job {args.job!r} has no records in {args.log}")
            report = replay_job(log, args.job, args.until)
            chain = verify_chains(read_streams(log, args.job)) if args.verify_chain else None
            what_if = (
                compare(args.job, log.read(Stream.EVENTS, args.job), settings)
                if args.what_if
                else None
            )
            if args.plot is not None:
                from flashrecovery.observe.plot import plot_job  # matplotlib: only when asked

                plot_job(log, args.job, args.plot, report)
    except (LogError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        document = report.to_json()
        if chain is not None:
            document["chain"] = chain.to_json()
        if what_if is not None:
            document["what_if"] = what_if.to_json()
        print(json.dumps(document, indent=2))
    else:
        print_replay(report)
        if chain is not None:
            print_chain(chain)
        if what_if is not None:
            print_what_if(what_if)
    if args.plot is not None:
        print(f"timeline: {args.plot}")
    return 0 if report.ok and (chain is None or chain.ok) else 1
