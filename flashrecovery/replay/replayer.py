"""The replayer: feed a job's recorded events through the pure engine again and check that
it reproduces every recorded decision, stopping at the first divergence (both records kept).
An event the engine did not believe (its RecordRejected decision says so) is not believed
again; with the job's keys the replayer checks every signature itself, and a decision not
signed by an engine is left out and listed, never taken for the engine's.
The report also tells the job's incidents: each phase's duration, the RTO and the steps lost.
The `replay` command around it is replay/command.py; its rendering, replay/report.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.connectors.believed import BelievedLog
from flashrecovery.connectors.signing import Keyring
from flashrecovery.engine.ingest import ingest
from flashrecovery.engine.recovery import phase_durations
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Decision, IncidentClosed, RecordRejected, Stream
from flashrecovery.replay import consistency


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
    # What must hold over the whole log whatever the network did (replay/consistency.py)
    unleased_deciders: list[str] = field(default_factory=list)
    double_commits: list[str] = field(default_factory=list)
    believed_from_lost_nodes: list[str] = field(default_factory=list)
    # Decisions no engine signed (only with the job's keys): "position: why"
    forged_decisions: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        """What must hold whatever the network did (replay/consistency.py)."""
        return not (self.unleased_deciders or self.double_commits or self.believed_from_lost_nodes)

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.consistent

    def incidents(self) -> list[dict[str, Any]]:
        closed = {d.incident_id: d for d in self.recorded_closures if isinstance(d, IncidentClosed)}
        out = []
        for incident in self.state.incidents:
            close = closed.get(incident.incident_id)
            out.append(
                {
                    "incident_id": incident.incident_id,
                    "failed_rank": incident.failed_rank,
                    "failed": incident.what_failed,
                    "state": incident.machine.state,
                    "reason": incident.reason,
                    "generation": incident.generation,
                    "phases_s": phase_durations(incident),
                    "rto_s": close.rto_s if close else None,
                    "rpo_steps": close.rpo_steps if close else None,
                    "recomputed_steps": close.recomputed_steps if close else None,
                    "resume_step": incident.resume_step,
                    "checkpoint_step": incident.checkpoint_step,
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
            "unleased_deciders": self.unleased_deciders,
            "double_commits": self.double_commits,
            "believed_from_lost_nodes": self.believed_from_lost_nodes,
            "forged_decisions": self.forged_decisions,
            "job_state": self.state.job.state,
            "verdict": self.state.verdict,
            "generation": self.state.generation,
            "ranks": {r: v.machine.state for r, v in sorted(self.state.ranks.items())},
            "rejected": dict(self.state.rejected),
            "fenced": self.state.fenced,
            "incidents": self.incidents(),
        }


def _as_dict(decision: Decision | None) -> dict[str, Any] | None:
    return None if decision is None else decision.model_dump(mode="json")


def replay_job(
    log: LogConnector, job_id: str, until: int | None = None, keys: Keyring | None = None
) -> ReplayReport:
    """Rebuild the job from its events (up to ``until`` inclusive) and check its decisions;
    with the job's ``keys``, every record's signature too (a believed view gives both: the
    replay must see what was forged to reproduce the engine's rejection of it)."""
    if isinstance(log, BelievedLog):
        keys = keys or log.keys
        log = log.inner
    report = ReplayReport(job_id, EngineState(job_id))
    recorded: dict[int, list[Decision]] = {}
    decisions: list[Entry] = []
    for entry in log.read(Stream.DECISIONS, job_id):
        forgery = _forgery(keys, entry)
        if forgery is not None:
            report.forged_decisions.append(f"{entry.position}: {forgery}")
        elif isinstance(entry.record, Decision):
            decisions.append(entry)
            recorded.setdefault(entry.record.caused_by, []).append(entry.record)
    last_recorded = max(recorded, default=-1)
    report.recorded_closures = [
        d for ds in recorded.values() for d in ds if d.type == "incident_closed"
    ]
    # The engine's word on the events it did not believe, where the keys cannot say
    disbelieved = {
        d.caused_by: d.reason
        for ds in recorded.values()
        for d in ds
        if isinstance(d, RecordRejected)
    }
    events = [e for e in log.read(Stream.EVENTS, job_id) if until is None or e.position <= until]
    forgeries = {
        e.position: why
        for e in events
        if (why := _forgery(keys, e) if keys else disbelieved.get(e.position)) is not None
    }
    believed = [e for e in events if e.position not in forgeries]
    report.unleased_deciders = consistency.deciders_without_lease(believed, decisions)
    report.double_commits = consistency.steps_committed_twice(believed, decisions)
    lost_writes = consistency.LostNodeWrites()
    report.believed_from_lost_nodes = lost_writes.believed
    for entry in events:
        report.events += 1
        forgery = forgeries.get(entry.position)
        if forgery is None:
            lost_writes.before(entry, report.state)
        replayed = ingest(report.state, entry, forgery)
        if forgery is None:
            lost_writes.after(entry, report.state)
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


def _forgery(keys: Keyring | None, entry: Entry) -> str | None:
    if keys is None or entry.record is None:
        return None
    return keys.forgery(entry.raw, entry.record)
