"""What-if replay: the recorded world, decided again under other policy settings.

The events a job recorded are facts about its processes (heartbeats, steps, exits); the detector
findings and every decision are consequences of its policy (the JobStarted settings). A what-if
run keeps the facts, swaps the policy, and decides again with the engine's pure decide step:

- the changed JobStarted replaces the recorded one;
- a detector whose settings changed is re-run (detectors.fresh_findings) on a simulated clock
  that looks after every record and every TICK_S in between, as the engine loop polls; its
  recorded findings are dropped. A detector whose settings did not change keeps its recorded
  findings: they are the ground truth of when the live engine noticed;
- another heartbeat interval resamples each process's heartbeats: a shorter one adds beats
  between two recorded ones, within the recorded interval after the first (the beating thread
  was alive at least that long), a longer one thins them;
- more spares add virtual ones, ready when the first real one was; fewer drop the spares the
  agent would not have kept (and what those spares did before taking a rank).

With the recorded settings nothing changes, so the decisions are the recorded ones exactly.
Otherwise the run is faithful up to its first different decision: the world that followed was
the recorded one, reacting to the recorded decisions. RTOs are therefore implied, not replayed:
for an incident both runs detected and replaced alike, the what-if RTO is the recorded one
shifted by the difference in detection time (the later phases keep their recorded durations).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from flashrecovery.connectors.base import Entry
from flashrecovery.engine import detectors
from flashrecovery.engine.decide import decide
from flashrecovery.engine.state import EngineState, Incident
from flashrecovery.errors import ConfigError
from flashrecovery.records import (
    AssignSpare,
    Decision,
    Envelope,
    Heartbeat,
    HeartbeatMissed,
    IncidentClosed,
    JobStarted,
    NodeHeartbeat,
    NodeMissed,
    NodeWaitExpired,
    RankExited,
    SpareActivated,
    SpareHeartbeat,
    SpareMissed,
    SpareReady,
    StallSuspected,
)

# --what-if NAME=VALUE: the short name, or the JobStarted field itself.
SETTINGS = {
    "heartbeat_interval": "heartbeat_interval_s",
    "missed_heartbeats": "missed_heartbeats",
    "startup_grace": "startup_grace_s",
    "stall_factor": "stall_factor",
    "stall_floor": "stall_floor_s",
    "spares": "spares",
    "max_replacements": "max_replacements",
    "max_incidents": "max_incidents",
}
SILENCE = ("heartbeat_interval_s", "missed_heartbeats", "startup_grace_s")
Beat = Heartbeat | SpareHeartbeat | NodeHeartbeat  # proofs of life, resampled with the interval
BEATS = (Heartbeat, SpareHeartbeat, NodeHeartbeat)
SILENCE_FINDINGS = (HeartbeatMissed, SpareMissed, NodeMissed, NodeWaitExpired)
STALLS = ("stall_factor", "stall_floor_s")
TICK_S = 0.05  # the simulated engine looks this often between records (the loop's poll)
SCALE = 1_000_000  # what-if positions: recorded p -> p * SCALE, inserted records after it
VIRTUAL_SPARE = 1_000_000  # ids (and pids) of spares only the what-if run has
FREEZE_S = 120.0  # longest wait for a what-if detection the recorded run made sooner
FRESH_BEATS = 1.5  # a process that beat within this many recorded intervals is beating
SEED = -1  # the position of a beat that is no record (a spare's readiness): never dropped
THIN_SLACK = 0.9  # a longer interval keeps a beat this fraction of it after the last kept


def parse_settings(specs: list[str]) -> dict[str, str]:
    """``["heartbeat_interval=0.5", …]`` -> {JobStarted field: value}; ConfigError says why not."""
    fields = set(SETTINGS.values())
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        field_name = SETTINGS.get(name.strip(), name.strip())
        if not sep or field_name not in fields:
            raise ConfigError(
                f"--what-if {spec!r}: expected NAME=VALUE with NAME one of {', '.join(SETTINGS)}"
            )
        out[field_name] = value.strip()
    return out


def with_settings(config: JobStarted, settings: dict[str, str]) -> JobStarted:
    values = {k: (None if v.lower() == "none" else v) for k, v in settings.items()}
    try:
        return JobStarted.model_validate({**config.model_dump(), **values})
    except ValidationError as exc:
        problems = "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"--what-if: {problems}") from None


# ------------------------------------------------------------------ the two runs


@dataclass
class Run:
    """One pass of decide over a world: its decisions (with the time of their cause) and state."""

    state: EngineState
    decisions: list[Decision] = field(default_factory=list)
    # Each what-if decision with the recorded one it stands for (None: only on one side).
    pairs: list[tuple[Decision | None, Decision | None]] = field(default_factory=list)

    def closed(self) -> dict[str, IncidentClosed]:
        return {d.incident_id or "": d for d in self.decisions if isinstance(d, IncidentClosed)}

    def replacement(self, incident_id: str) -> str | None:
        for d in self.decisions:
            if d.incident_id == incident_id and d.type in ("assign_spare", "spawn_replacement"):
                return "hot spare" if isinstance(d, AssignSpare) else "fresh process"
        return None


def run_recorded(job_id: str, events: list[Entry]) -> Run:
    run = Run(EngineState(job_id))
    for entry in events:
        if entry.record is not None:
            run.decisions += decide(run.state, entry.position, entry.record)
    return run


@dataclass
class _World:
    """The what-if world as it is fed to decide, one record at a time, in time order."""

    recorded: JobStarted
    policy: JobStarted
    silence: bool  # re-run the heartbeat detectors
    stalls: bool  # re-run the stall detector
    dropped_spares: set[int] = field(default_factory=set)

    @property
    def identical(self) -> bool:
        return self.policy == self.recorded

    def keeps(self, record: Envelope, state: EngineState) -> bool:
        """Whether a recorded record is part of the what-if world."""
        if record.source == "detector" and (
            (self.silence and isinstance(record, SILENCE_FINDINGS))
            or (self.stalls and isinstance(record, StallSuspected))
        ):
            return False
        fewer = self.policy.spares < self.recorded.spares
        if (
            isinstance(record, SpareReady)
            and fewer
            and len(state.ready_spares()) >= self.policy.spares
        ):
            self.dropped_spares.add(record.spare_id)  # the agent would not have kept it
            return False
        spare_id = getattr(record, "spare_id", None)
        spare_only = isinstance(record, SpareHeartbeat | SpareActivated | SpareMissed) or (
            isinstance(record, RankExited) and record.rank is None
        )
        return not (spare_only and spare_id in self.dropped_spares)


def _beats(events: list[Entry], recorded: float, policy: float) -> tuple[set[int], list[Envelope]]:
    """Heartbeats resampled from the recorded interval to the policy's: the positions of the
    recorded beats to drop, and the beats to add (each process on its own)."""
    if policy == recorded:
        return set(), []
    by_process: dict[tuple[str, int, int], list[tuple[int, Beat]]] = {}
    for entry in events:
        record = entry.record
        if isinstance(record, SpareReady) and policy < recorded:
            # A spare beats from the moment it is ready: its first beat under the policy's
            # interval comes that long after, not when its first recorded one did.
            ready = SpareHeartbeat(**_envelope(record), spare_id=record.spare_id, pid=record.pid)
            by_process.setdefault(_process(ready), []).append((SEED, ready))
        if not isinstance(record, BEATS):
            continue
        by_process.setdefault(_process(record), []).append((entry.position, record))
        if isinstance(record, NodeHeartbeat) and policy < recorded:
            # The beats a node's record carries are its processes' own, at the record's
            # time (as the engine applies them): each process is resampled on its own, for
            # a rank's beat may miss one node record and ride the next.
            for beat in record.beats:
                at_node = beat.model_copy(update={"ts": record.ts, "record_id": record.record_id})
                by_process.setdefault(_process(at_node), []).append((entry.position, at_node))
    dropped: set[int] = set()
    added: list[Envelope] = []
    for beats in by_process.values():
        kept = beats[0][1]
        for (position, record), following in zip(beats, [*beats[1:], None], strict=True):
            if policy > recorded:
                if record is not kept and record.ts - kept.ts < THIN_SLACK * policy:
                    dropped.add(position)
                else:
                    kept = record
                continue
            if following is None:
                continue  # after a process's last beat nothing says it was alive
            until = min(following[1].ts, record.ts + recorded)
            k = 1
            while record.ts + k * policy < until:
                added.append(_beat_at(record, k, round(record.ts + k * policy, 6)))
                k += 1
    return dropped, added


def _envelope(record: Envelope) -> dict[str, Any]:
    fields = ("job_id", "generation", "source", "ts", "record_id")
    return {name: getattr(record, name) for name in fields}


def _beat_at(record: Beat, k: int, ts: float) -> Envelope:
    """The ``k``-th beat added after ``record``: a node's carries nothing of its own (its
    processes' beats and its link samples are resampled, or counted, once)."""
    whose = ":".join(map(str, _process(record)))  # a node's record carries several beats
    update: dict[str, Any] = {"ts": ts, "record_id": f"what-if:{record.record_id}:{whose}:{k}"}
    if isinstance(record, NodeHeartbeat):
        update |= {"beats": [], "links": []}
    return record.model_copy(update={**update, "chain": None})


def _virtual_spares(
    events: list[Entry], recorded: JobStarted, policy: JobStarted
) -> list[Envelope]:
    """Spares the what-if pool has beyond the recorded one, ready when the first real one was."""
    extra = policy.spares - recorded.spares
    if extra <= 0:
        return []
    first = next((e.record for e in events if isinstance(e.record, SpareReady)), None)
    ts = first.ts if first is not None else recorded.ts
    host = first.host if first is not None else "what-if"
    return [
        SpareReady(
            job_id=recorded.job_id,
            generation=0,
            source="what-if",
            ts=ts,
            record_id=f"what-if:spare:{k}",
            spare_id=VIRTUAL_SPARE + k,
            pid=VIRTUAL_SPARE + k,
            host=host,
        )
        for k in range(extra)
    ]


def run_what_if(job_id: str, events: list[Entry], settings: dict[str, str]) -> tuple[Run, _World]:
    """Decide again over the recorded events under the changed settings."""
    recorded = next((e.record for e in events if isinstance(e.record, JobStarted)), None)
    if recorded is None:
        raise ConfigError(f"job {job_id!r} has no job_started record: no settings to change")
    policy = with_settings(recorded, settings).model_copy(
        update={"record_id": recorded.record_id, "chain": None}
    )
    world = _World(
        recorded,
        policy,
        silence=any(getattr(policy, f) != getattr(recorded, f) for f in SILENCE),
        stalls=any(getattr(policy, f) != getattr(recorded, f) for f in STALLS),
    )
    recorded_run = run_recorded(job_id, events)
    if world.identical:
        recorded_run.pairs = [(d, d) for d in recorded_run.decisions]
        return recorded_run, world
    dropped, added = _beats(events, recorded.heartbeat_interval_s, policy.heartbeat_interval_s)
    added += _virtual_spares(events, recorded, policy)
    feeder = _Feeder(Run(EngineState(job_id)), world, recorded_run.decisions)
    items = list(_merged(events, dropped, added))
    for i, (position, record) in enumerate(items):
        if feeder.ended:
            break
        if feeder.preempted(position, items[i:]):
            continue
        if position is not None and not world.keeps(record, feeder.run.state):
            feeder.after_recorded(position)
            continue
        feeder.feed(policy if isinstance(record, JobStarted) else feeder.shifted(record), position)
        if position is not None:
            feeder.after_recorded(position)
        feeder.detect_until(items[i + 1][1].ts + feeder.shift if i + 1 < len(items) else None)
    feeder.unmatched_rest()
    return feeder.run, world


def same(a: Decision, b: Decision) -> bool:
    """The same decision at the same time (ids and causes aside)."""
    return describe(a) == describe(b) and abs(a.ts - b.ts) < 1e-6


SHIFTED = ("ts", "last_seen_ts", "expires_ts")  # the times a record carries


@dataclass
class _Feeder:
    """Feeds the what-if world to decide, runs the re-simulated detectors on a simulated clock,
    and pairs the what-if decisions with the recorded ones in order.

    When the what-if run makes a recorded decision at another time, the recorded world's
    reaction to it moves with it: records after that decision's cause are fed ``shift`` seconds
    later (or earlier); records between an earlier decision and the recorded one's cause are
    pre-empted (that part of the recorded world did not happen). When the recorded run decided
    something at a record where the what-if run decided nothing, the world is frozen there: the
    processes that were beating go on beating, the detectors look every TICK_S, for up to
    FREEZE_S, until the what-if run decides it too."""

    run: Run
    world: _World
    recorded: list[Decision]
    reported: set[detectors.FindingKey] = field(default_factory=set)
    matched: int = 0  # recorded decisions paired so far, in order
    shift: float = 0.0
    skip_to: int = -1  # recorded positions up to this one are pre-empted
    base: int = 0  # scaled position of the last recorded record fed
    inserted: int = 0  # records fed since it
    clock: float = 0.0
    beats: dict[tuple[str, int, int], Envelope] = field(default_factory=dict)
    ended: bool = False  # a freeze found nothing: what follows in the log did not happen

    def shifted(self, record: Envelope) -> Envelope:
        if not self.shift:
            return record
        times = {k: getattr(record, k) + self.shift for k in SHIFTED if hasattr(record, k)}
        return record.model_copy(update=times)

    def preempted(self, position: int | None, rest: list[tuple[int | None, Envelope]]) -> bool:
        """Whether this item lies before the cause of a recorded decision made earlier."""
        upcoming = (
            position if position is not None else next((p for p, _ in rest if p is not None), None)
        )
        return upcoming is not None and upcoming <= self.skip_to

    def feed(self, record: Envelope, recorded_position: int | None) -> None:
        if recorded_position is not None:
            self.base, self.inserted = recorded_position * SCALE, 0
        else:
            self.inserted += 1
        decided = decide(self.run.state, self.base + self.inserted, record)
        self.run.decisions += decided
        self.clock = max(self.clock, record.ts)
        if isinstance(record, BEATS):
            self.beats[_process(record)] = record
        for decision in decided:
            self._pair(decision)

    def _pair(self, decision: Decision) -> None:
        """Pair with the next recorded decision of the same kind among those the same event
        caused (the ones skipped over were not made); else the decision is the what-if's own."""
        batch = self.recorded[self.matched :]
        cause = batch[0].caused_by if batch else None
        k = next(
            (
                k
                for k, d in enumerate(batch)
                if d.caused_by == cause and describe(d) == describe(decision)
            ),
            None,
        )
        if k is None:
            self.run.pairs.append((None, decision))
            return
        self.run.pairs += [(d, None) for d in batch[:k]]
        recorded = batch[k]
        self.matched += k + 1
        self.run.pairs.append((recorded, decision))
        if decision.ts < recorded.ts + self.shift - 1e-9:
            self.skip_to = max(self.skip_to, recorded.caused_by)
        self.shift = decision.ts - recorded.ts

    def _owed(self, position: int) -> list[Decision]:
        """Recorded decisions caused at or before ``position`` the what-if has not made."""
        return [d for d in self.recorded[self.matched :] if d.caused_by <= position]

    def after_recorded(self, position: int) -> None:
        owed = self._owed(position)
        if not owed:
            return
        decided_here = any(d.caused_by // SCALE == position for d in self.run.decisions)
        if decided_here or not self._freeze(position):
            for decision in self._owed(position):  # decided otherwise, or never
                self.run.pairs.append((decision, None))
                self.matched += 1
            self.ended = not decided_here

    def _freeze(self, position: int) -> bool:
        """Let time pass in the what-if world until it decides what the recorded run decided
        at ``position``; False if it does not within FREEZE_S."""
        policy = self.world.policy
        start = self.clock
        fresh = FRESH_BEATS * self.world.recorded.heartbeat_interval_s
        alive = {k: b for k, b in self.beats.items() if start - b.ts <= fresh}
        now = start
        while now <= start + FREEZE_S:
            for key, beat in alive.items():
                while beat.ts + policy.heartbeat_interval_s <= now:
                    beat = beat.model_copy(update={"ts": beat.ts + policy.heartbeat_interval_s})
                    self.feed(beat, None)
                alive[key] = beat
            self._look(now)
            if not self._owed(position):
                return True
            now = round(now + TICK_S, 6)
        return False

    def _look(self, now: float) -> None:
        state = self.run.state
        findings = detectors.fresh_findings(
            state, now, self.reported, silence=self.world.silence, stalls=self.world.stalls
        )
        for finding in findings:
            self.reported.add(detectors.finding_key(state, finding))
            self.feed(finding, None)

    def detect_until(self, until: float | None) -> None:
        """Look right after the last record, then every TICK_S until the next one."""
        if not (self.world.silence or self.world.stalls):
            return
        now = self.clock
        while True:
            self._look(now)
            now = round(now + TICK_S, 6)
            if until is None or now >= until:
                return

    def unmatched_rest(self) -> None:
        for decision in self.recorded[self.matched :]:
            self.run.pairs.append((decision, None))
        self.matched = len(self.recorded)


def _process(beat: Beat) -> tuple[str, int, int]:
    """Whose beat: a rank's, a spare's or a node's agent's process."""
    if isinstance(beat, Heartbeat):
        return (beat.type, beat.rank, beat.pid)
    if isinstance(beat, SpareHeartbeat):
        return (beat.type, beat.spare_id, beat.pid)
    return (beat.type, beat.node, beat.pid)


def _merged(
    events: list[Entry], dropped: set[int], added: list[Envelope]
) -> Iterator[tuple[int | None, Envelope]]:
    """Recorded records in log order with their positions (minus the dropped ones), each added
    record (position None) just before the first recorded one that is later than it."""
    pending = [(r.ts, i, r) for i, r in enumerate(added)]
    heapq.heapify(pending)
    for entry in events:
        record = entry.record
        if record is None or entry.position in dropped:
            continue
        while pending and pending[0][0] < record.ts:
            yield None, heapq.heappop(pending)[2]
        yield entry.position, record
    while pending:
        yield None, heapq.heappop(pending)[2]


# ------------------------------------------------------------------ side by side

SHOWN = ("rank", "spare_id", "failed_rank", "members", "replaced", "resume_step", "recipients")


def describe(decision: Decision) -> str:
    """A decision by what it decides (no ids, times or wording with durations in it)."""
    fields = [f"{k}={getattr(decision, k)}" for k in SHOWN if hasattr(decision, k)]
    return f"{decision.type}({', '.join(fields)}) gen {decision.generation}"


@dataclass
class Comparison:
    """The recorded run and the what-if run, side by side."""

    job_id: str
    recorded: Run
    what_if: Run
    world: _World

    @property
    def t0(self) -> float:
        return self.world.recorded.ts

    @property
    def changed(self) -> dict[str, tuple[Any, Any]]:
        return {
            name: (getattr(self.world.recorded, name), getattr(self.world.policy, name))
            for name in SETTINGS.values()
            if getattr(self.world.recorded, name) != getattr(self.world.policy, name)
        }

    @property
    def exact(self) -> bool:
        """The what-if run made exactly the recorded decisions (ids and times included)."""
        return self.recorded.decisions == self.what_if.decisions

    def decision_rows(self) -> list[dict[str, Any]]:
        rows = []
        for a, b in self.what_if.pairs:
            rows.append(
                {
                    "recorded": None if a is None else describe(a),
                    "recorded_at_s": None if a is None else round(a.ts - self.t0, 6),
                    "what_if": None if b is None else describe(b),
                    "what_if_at_s": None if b is None else round(b.ts - self.t0, 6),
                    "same": a is not None and b is not None and same(a, b),
                }
            )
        return rows

    def first_difference(self) -> int | None:
        return next((i for i, row in enumerate(self.decision_rows()) if not row["same"]), None)

    def incident_rows(self) -> list[dict[str, Any]]:
        pending = list(self.what_if.state.incidents)
        rows = []
        for incident in self.recorded.state.incidents:
            twin = next((i for i in pending if i.failed_rank == incident.failed_rank), None)
            if twin is not None:
                pending.remove(twin)
            rows.append(self._row(incident, twin))
        rows += [self._row(None, twin) for twin in pending]
        return rows

    def _row(self, ours: Incident | None, theirs: Incident | None) -> dict[str, Any]:
        either = ours or theirs
        assert either is not None
        row: dict[str, Any] = {"failed_rank": either.failed_rank}
        for side, incident in (("recorded", ours), ("what_if", theirs)):
            row[f"{side}_cause"] = incident.detected.cause if incident else None
            row[f"{side}_detected_at_s"] = (
                round(incident.detected.ts - self.t0, 6) if incident else None
            )
            row[f"{side}_detection_s"] = (
                round(incident.detected.ts - incident.failure_ts, 6) if incident else None
            )
        closed = self.recorded.closed().get(ours.incident_id) if ours else None
        row["recorded_rto_s"] = closed.rto_s if closed else None
        row["what_if_rto_s"], row["note"] = self._what_if_rto(ours, theirs)
        return row

    def _what_if_rto(
        self, ours: Incident | None, theirs: Incident | None
    ) -> tuple[float | None, str]:
        """The what-if RTO where the recorded recovery can stand for it, else why not."""
        if theirs is None:
            return None, "not detected under the what-if settings"
        if ours is None:
            return None, (
                "an incident the recorded run did not have (a false alarm, or a fault found "
                "another way): what would have followed was not recorded"
            )
        kinds = (
            self.recorded.replacement(ours.incident_id),
            self.what_if.replacement(theirs.incident_id),
        )
        if kinds[0] != kinds[1]:
            return None, (
                f"replaced by a {kinds[1]} instead of a {kinds[0]}: how long that takes was not "
                "recorded"
            )
        closed = self.what_if.closed().get(theirs.incident_id)
        if closed is None:
            return None, "the what-if recovery does not end within the recorded log"
        sooner = (ours.detected.ts - ours.failure_ts) - (theirs.detected.ts - theirs.failure_ts)
        if abs(sooner) < 1e-6:
            return closed.rto_s, "detected alike"
        when = "earlier" if sooner > 0 else "later"
        return closed.rto_s, (
            f"detected {abs(sooner) * 1000:.0f} ms {when}; the recorded recovery after detection, "
            "moved with it"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "changed": {k: {"recorded": a, "what_if": b} for k, (a, b) in self.changed.items()},
            "exact": self.exact,
            "first_difference": self.first_difference(),
            "decisions": self.decision_rows(),
            "incidents": self.incident_rows(),
        }


def compare(job_id: str, events: list[Entry], settings: dict[str, str]) -> Comparison:
    """The recorded decisions and the ones the changed settings imply, side by side."""
    what_if, world = run_what_if(job_id, events, settings)
    return Comparison(job_id, run_recorded(job_id, events), what_if, world)
