"""What a job's timeline picture shows, computed from its log alone (replay/plot.py draws it).

Lanes: one per rank (committed steps as ticks, faults marked, each incident's phases as spans),
one per host (when its ranks were heard from, and the faults on it), one per hot spare (ready
until taken or gone) and one for the engine lease holder. Incident phases come from the replay
(replay/replayer.py): each span lasts exactly the phase duration replay reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashrecovery.connectors.base import Entry
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.records import (
    CollectiveError,
    EngineLease,
    Envelope,
    HealthReport,
    Heartbeat,
    HeartbeatMissed,
    JobFinished,
    RankExited,
    RankJoined,
    SpareActivated,
    SpareReady,
    StallSuspected,
    StepCompleted,
)
from flashrecovery.replay.replayer import ReplayReport
from flashrecovery.statemachines.incident import PHASES


@dataclass(frozen=True)
class Span:
    lane: str
    start: float  # seconds since the job started
    end: float
    label: str
    kind: str  # a phase name, "spare", "lease", "heard"


@dataclass(frozen=True)
class Mark:
    lane: str
    at: float
    label: str
    kind: str  # "commit", "fault", "symptom", "takeover" (a spare took a rank, or died)


@dataclass
class Timeline:
    job_id: str
    t0: float  # unix time of the job's first record
    end: float  # seconds since t0 of its last record
    lanes: list[str] = field(default_factory=list)  # top to bottom
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    def incidents(self) -> dict[str, tuple[float, float]]:
        """Each incident's id -> (fault, end of its last phase)."""
        out: dict[str, tuple[float, float]] = {}
        for span in self.spans:
            if span.kind in PHASES:
                incident = span.label.split(" ", 1)[0]
                start, end = out.get(incident, (span.start, span.end))
                out[incident] = (min(start, span.start), max(end, span.end))
        return out

    def phases(self, incident_id: str) -> dict[str, float]:
        """An incident's phase durations as the picture shows them."""
        return {
            s.kind: round(s.end - s.start, 6)
            for s in self.spans
            if s.label.startswith(f"{incident_id} ")
        }


def rank_lane(rank: int) -> str:
    return f"rank {rank}"


SYMPTOMS = (HeartbeatMissed, StallSuspected, CollectiveError, HealthReport)
# Where a fault that no exit record shows began (at the incident's estimated fault time).
SILENT_FAULTS = {
    "heartbeat_missed": "silent from here",
    "stall_suspected": "stuck from here",
    "health_report": "unhealthy",
}


def build(events: list[Entry], report: ReplayReport) -> Timeline:
    """The timeline of a job from its events and the replay of them."""
    entries = [e for e in events if e.record is not None]
    records = [e.record for e in entries if e.record is not None]
    revealing = {i.detected.position for i in report.state.incidents}
    if not records:
        return Timeline(report.job_id, 0.0, 0.0)
    t0 = records[0].ts
    line = Timeline(report.job_id, t0, records[-1].ts - t0)
    ranks = sorted(report.state.ranks)
    hosts: dict[str, list[float]] = {}
    spares: dict[int, tuple[float, str]] = {}  # spare id -> (ready at, host)
    for entry, record in zip(entries, records, strict=True):
        at = record.ts - t0
        host = getattr(record, "host", None)
        if isinstance(record, Heartbeat | RankJoined) and host:
            hosts.setdefault(host, []).append(at)
        for beat in getattr(record, "beats", ()):  # a node's record carries its ranks' beats
            if isinstance(beat, Heartbeat):
                hosts.setdefault(beat.host, []).append(at)
        if isinstance(record, StepCompleted):
            line.marks.append(Mark(rank_lane(record.rank), at, str(record.step), "commit"))
        elif isinstance(record, RankExited) and record.rank is not None:
            # The exit that revealed an incident is its fault; a later one (an isolated process
            # killed, the end of the job) is only a symptom, and exit 0 is the normal end.
            kind = "fault" if entry.position in revealing else "symptom"
            if record.signal is not None or record.exit_code:
                line.marks.append(Mark(rank_lane(record.rank), at, _exit_label(record), kind))
        elif isinstance(record, SYMPTOMS) and not getattr(record, "ok", False):
            line.marks.append(Mark(rank_lane(record.rank), at, _symptom_label(record), "symptom"))
        elif isinstance(record, SpareReady):
            spares[record.spare_id] = (at, record.host)
        elif isinstance(record, SpareActivated | RankExited) and record.spare_id in spares:
            start, _ = spares.pop(record.spare_id)
            lane = f"spare {record.spare_id}"
            line.spans.append(Span(lane, start, at, "ready", "spare"))
            taken = isinstance(record, SpareActivated)
            line.marks.append(
                Mark(lane, at, f"→ rank {record.rank}" if taken else "exited", "takeover")
            )
        elif isinstance(record, JobFinished):
            line.marks.append(Mark("engine", at, f"job {record.status}", "symptom"))
    for spare_id, (start, _) in spares.items():
        line.spans.append(Span(f"spare {spare_id}", start, line.end, "ready", "spare"))
    line.spans.extend(_lease_spans(records, t0, line.end))
    line.spans.extend(_phase_spans(report, t0, line.marks))
    for host, seen in sorted(hosts.items()):
        line.spans.append(Span(f"host {host}", min(seen), max(seen), "heard from", "heard"))
    spare_lanes = sorted({s.lane for s in line.spans if s.kind == "spare"}, key=_number)
    line.lanes = [
        *(rank_lane(r) for r in ranks),
        *(f"host {h}" for h in sorted(hosts)),
        *spare_lanes,
        "engine",
    ]
    return line


def _number(lane: str) -> int:
    return int(lane.rsplit(" ", 1)[-1])


def _exit_label(record: RankExited) -> str:
    return f"signal {record.signal}" if record.signal is not None else f"exit {record.exit_code}"


def _symptom_label(
    record: HeartbeatMissed | StallSuspected | CollectiveError | HealthReport,
) -> str:
    if isinstance(record, HeartbeatMissed):
        return f"silent {record.silent_s:.1f}s"
    if isinstance(record, StallSuspected):
        return f"stalled {record.stalled_s:.1f}s"
    return record.type


def _phase_spans(report: ReplayReport, t0: float, marks: list[Mark]) -> list[Span]:
    """Each phase from the end of the previous one, lasting what replay says it lasted; a fault
    no exit shows is marked where the incident estimates it began."""
    spans = []
    for incident, row in zip(report.state.incidents, report.incidents(), strict=True):
        start = incident.failure_ts - t0
        if incident.detected.cause in SILENT_FAULTS:
            lane, label = rank_lane(incident.failed_rank), SILENT_FAULTS[incident.detected.cause]
            marks.append(Mark(lane, start, label, "fault"))
        for phase, seconds in row["phases_s"].items():
            label = f"{incident.incident_id} {phase} {seconds * 1000:.0f} ms"
            spans.append(
                Span(rank_lane(incident.failed_rank), start, start + seconds, label, phase)
            )
            start += seconds
    return spans


def _lease_spans(records: list[Envelope], t0: float, end: float) -> list[Span]:
    """Who held the engine lease (as engine/lease.py grants it), merged over renewals; without
    leases the agent's own engine decided throughout."""
    book = LeaseBook()
    spans: list[Span] = []
    for lease in records:
        if not book.fold(lease) or not isinstance(lease, EngineLease):
            continue  # refused (another engine held it), or no lease
        start, until = lease.ts - t0, min(lease.expires_ts - t0, end)
        last = spans[-1] if spans else None
        if last is not None and last.label == lease.engine_id and start <= last.end:
            spans[-1] = Span("engine", last.start, max(last.end, until), last.label, "lease")
        else:
            spans.append(Span("engine", start, until, lease.engine_id, "lease"))
    return spans or [Span("engine", 0.0, end, "engine in the agent", "lease")]
