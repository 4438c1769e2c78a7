"""The decide step: (state, event) -> decisions. No clock, no I/O, nothing random.

Every decision takes its id, timestamp and generation from the event that caused it, so feeding
the same events again yields byte-identical decisions: that is what replay checks and what lets a
restarted engine recognise what it had already written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flashrecovery.connectors.base import Entry
from flashrecovery.engine import planner
from flashrecovery.engine.state import EngineState, Incident, RankView, SpareView
from flashrecovery.errors import IllegalTransition, Rejected
from flashrecovery.records import (
    AssignSpare,
    CollectiveError,
    Decision,
    EngineLease,
    Envelope,
    FallbackToCheckpoint,
    HealthReport,
    Heartbeat,
    HeartbeatMissed,
    IncidentClosed,
    IsolateRank,
    JobFinished,
    JobStarted,
    RankExited,
    RankFinished,
    RankJoined,
    RankRegrouped,
    RegroupPlanned,
    ReplacementSpawned,
    ResumePlanned,
    SpareActivated,
    SpareReady,
    SpawnReplacement,
    StallSuspected,
    StateTransferred,
    StepCompleted,
    decision_id,
)
from flashrecovery.statemachines.base import Stamp
from flashrecovery.statemachines.incident import PHASES, IncidentMachine
from flashrecovery.statemachines.rank import ALIVE, RankMachine

# Records a member sends about itself in its generation; older generations are fenced.
FENCED_TYPES = (
    RankJoined,
    Heartbeat,
    StepCompleted,
    CollectiveError,
    RankRegrouped,
    StateTransferred,
    HealthReport,
    RankFinished,
    HeartbeatMissed,
    StallSuspected,
)
STEP_WINDOW = 20  # step durations kept per rank for the stall threshold


D = TypeVar("D", bound=Decision)


@dataclass
class Context:
    """One decide call: the event being applied and the decisions it produces."""

    state: EngineState
    position: int
    record: Envelope
    decisions: list[Decision] = field(default_factory=list)

    @property
    def stamp(self) -> Stamp:
        return Stamp(self.position, self.record.ts, self.record.type)

    def emit(self, cls: type[D], generation: int | None = None, **fields: Any) -> D:
        decision = cls(
            record_id=decision_id(self.state.job_id, self.position, len(self.decisions)),
            job_id=self.state.job_id,
            generation=self.state.generation if generation is None else generation,
            source="engine",
            ts=self.record.ts,
            caused_by=self.position,
            **fields,
        )
        self.decisions.append(decision)
        return decision


def ingest(state: EngineState, entry: Entry) -> list[Decision]:
    """Apply one log entry; a malformed one is counted and explained, never raised."""
    if entry.record is None:
        _reject(state, f"malformed: {entry.error}")
        state.position = max(state.position, entry.position)
        return []
    return decide(state, entry.position, entry.record)


def decide(state: EngineState, position: int, record: Envelope) -> list[Decision]:
    """Apply one event at its log position and return the decisions it causes.

    A record that can't apply (wrong job, unknown rank, illegal transition) is counted in
    ``state.rejected`` with its reason and produces nothing; a stale generation's record is
    counted in ``state.fenced``.
    """
    state.position = max(state.position, position)
    ctx = Context(state, position, record)
    try:
        _apply(ctx)
    except (Rejected, IllegalTransition) as exc:
        _reject(state, f"{record.type}: {exc}")
        return []
    return ctx.decisions


def _reject(state: EngineState, reason: str) -> None:
    state.rejected[reason] += 1
    state.last_rejection = reason


def _apply(ctx: Context) -> None:
    state, record = ctx.state, ctx.record
    if record.job_id != state.job_id:
        raise Rejected(f"belongs to job {record.job_id!r}, not {state.job_id!r}")
    if isinstance(record, Decision):
        raise Rejected("a decision on the events stream")
    if isinstance(record, JobStarted):
        _job_started(ctx, record)
        return
    if isinstance(record, EngineLease):
        return  # engines may claim a job before it starts; leases decide nothing here
    if state.config is None:
        raise Rejected("no job_started record before it")
    rank = getattr(record, "rank", None)
    if rank is not None and rank not in state.ranks:
        raise Rejected(f"rank {rank} is outside the world of {state.world_size}")
    if isinstance(record, FENCED_TYPES) and record.generation < state.generation:
        state.fenced += 1
        return
    if isinstance(record, FENCED_TYPES) and record.generation > state.generation:
        raise Rejected(f"generation {record.generation} is ahead of {state.generation}")
    HANDLERS[type(record)](ctx, record)


# ------------------------------------------------------------------ handlers


def _job_started(ctx: Context, record: JobStarted) -> None:
    state = ctx.state
    if state.config is not None:
        raise Rejected("the job has already started")
    state.config = record
    state.ranks = {
        r: RankView(RankMachine(f"rank:{r}"), grace_until_ts=record.ts + record.startup_grace_s)
        for r in range(record.world_size)
    }


def _rank_joined(ctx: Context, record: RankJoined) -> None:
    state = ctx.state
    shards = state.config.shards if state.config else 1
    if record.shard >= shards:
        raise Rejected(f"shard {record.shard} is outside the job's {shards} shard(s)")
    view = state.ranks[record.rank]
    view.machine.fire("join", ctx.stamp)
    view.machine.fire("ready", ctx.stamp)
    view.pid, view.host, view.shard = record.pid, record.host, record.shard
    view.last_heartbeat_ts, view.grace_until_ts = record.ts, None
    if state.job.state == "starting" and all(
        v.machine.state == "healthy" for v in state.ranks.values()
    ):
        state.job.fire("run", ctx.stamp)


def _spare_ready(ctx: Context, record: SpareReady) -> None:
    if record.spare_id in ctx.state.spares:
        raise Rejected(f"spare {record.spare_id} is already known")
    ctx.state.spares[record.spare_id] = SpareView(record.spare_id, record.pid, record.host)


def _heartbeat(ctx: Context, record: Heartbeat) -> None:
    view = ctx.state.ranks[record.rank]
    if view.machine.state == "pending" and view.pid is None:
        view.pid = record.pid  # alive before it could join: its process is known from now on
    if view.pid != record.pid:
        ctx.state.fenced += 1  # an old process of this rank id
        return
    view.last_heartbeat_ts, view.grace_until_ts = record.ts, None  # alive: the grace is over
    view.waiting = record.waiting
    if not _stalled_by(ctx.state, view):
        _clear_suspicion(ctx, view)


def _stalled_by(state: EngineState, view: RankView) -> bool:
    """A heartbeat proves life, not progress: a suspect behind its peers, or outside commit()
    while a peer waits inside it, stays suspect."""
    behind = view.committed_step < state.max_committed()
    return behind or (not view.waiting and any(v.waiting for v in state.ranks.values()))


def _step_completed(ctx: Context, record: StepCompleted) -> None:
    state = ctx.state
    view = state.ranks[record.rank]
    view.committed_step = max(view.committed_step, record.step)
    view.last_step_ts = record.ts
    view.waiting = False
    view.step_durations = [*view.step_durations[-(STEP_WINDOW - 1) :], record.duration_s]
    _clear_suspicion(ctx, view)
    _maybe_close_incidents(ctx)


def _rank_exited(ctx: Context, record: RankExited) -> None:
    state = ctx.state
    holder = next((r for r, v in state.ranks.items() if v.pid == record.pid), None)
    if holder is None and record.rank is not None:
        never_joined = state.ranks[record.rank].machine.state == "pending"
        holder = record.rank if never_joined else None  # died before saying who it was
    if holder is None:
        spare = state.spares.get(record.spare_id) if record.spare_id is not None else None
        if spare is not None and spare.pid == record.pid:
            spare.status = "gone"
        else:
            state.fenced += 1  # a process that no longer holds any rank
        return
    view = state.ranks[holder]
    if view.machine.state == "finished":
        return
    if view.machine.state == "isolated":  # its replacement died before taking over
        if record.spare_id in state.spares:
            state.spares[record.spare_id].status = "gone"
        incident = next(i for i in reversed(state.open_incidents()) if i.failed_rank == holder)
        _choose_replacement(ctx, holder, incident.incident_id)
        return
    how = f"signal {record.signal}" if record.signal is not None else f"code {record.exit_code}"
    _fail(ctx, holder, record.ts, f"process {record.pid} exited ({how})")


def _collective_error(ctx: Context, record: CollectiveError) -> None:
    """A symptom, not a culprit: the reporting rank waits for the decision that the exit or
    a detector brings; nothing to decide from this record alone."""


def _heartbeat_missed(ctx: Context, record: HeartbeatMissed) -> None:
    reason = f"no heartbeat for {record.silent_s:.2f}s"
    _fail(ctx, record.rank, record.last_seen_ts, reason)


def _stall_suspected(ctx: Context, record: StallSuspected) -> None:
    machine = ctx.state.ranks[record.rank].machine
    if machine.state == "healthy":
        machine.fire("suspect", ctx.stamp)
    elif machine.state == "suspect":
        reason = f"no progress past step {record.last_step} for {record.stalled_s:.2f}s"
        _fail(ctx, record.rank, record.ts - record.stalled_s, reason)


def _health_report(ctx: Context, record: HealthReport) -> None:
    view = ctx.state.ranks[record.rank]
    if record.ok:
        _clear_suspicion(ctx, view)
    else:
        _fail(ctx, record.rank, record.ts, f"health check failed: {record.detail}")


def _spare_activated(ctx: Context, record: SpareActivated) -> None:
    spare = ctx.state.spares.get(record.spare_id)
    if spare is None:
        raise Rejected(f"spare {record.spare_id} never reported ready")
    spare.status = "assigned"
    _replacement_ready(ctx, record.rank, record.pid, warm=True)


def _replacement_spawned(ctx: Context, record: ReplacementSpawned) -> None:
    _replacement_ready(ctx, record.rank, record.pid, warm=False)


def _rank_regrouped(ctx: Context, record: RankRegrouped) -> None:
    state = ctx.state
    view = state.ranks[record.rank]
    if view.machine.state == "isolated" and view.pid in (None, record.pid):
        _replacement_ready(ctx, record.rank, record.pid, warm=True)  # spoke before the agent
    if view.machine.state == "pending":  # generation 0 never formed: it joins in this one
        view.machine.fire("join", ctx.stamp)
        view.pid, view.host = record.pid, ""
    if view.pid != record.pid:
        state.fenced += 1
        return
    if view.machine.state == "joining":
        view.machine.fire("pause", ctx.stamp)
    if view.machine.state != "paused":
        raise Rejected(f"rank {record.rank} is {view.machine.state}, not regrouping")
    view.regrouped_step = record.committed_step
    view.shard = record.shard
    if state.resume_planned or any(v.regrouped_step is None for v in state.ranks.values()):
        return
    for incident in state.open_incidents():
        if incident.machine.can("regrouped"):
            incident.machine.fire("regrouped", ctx.stamp)
    plan = planner.plan_resume(state)
    if isinstance(plan, planner.NoReplica):
        ctx.emit(
            FallbackToCheckpoint,
            reason=f"no healthy replica holds shard(s) {plan.shards}",
            shards=plan.shards,
            incident_id=_latest_incident_id(state),
        )
        for incident in state.open_incidents():
            incident.machine.fire("fall_back", ctx.stamp)
        state.job.fire("fall_back", ctx.stamp)
        return
    ctx.emit(
        ResumePlanned,
        resume_step=plan.resume_step,
        donors=plan.donors,
        recipients=plan.recipients,
        incident_id=_latest_incident_id(state),
    )
    state.resume_planned = True
    for incident in state.open_incidents():
        incident.resume_step = plan.resume_step
    state.job.fire("restore", ctx.stamp)
    for rank, member in state.ranks.items():
        member.machine.fire("restore", ctx.stamp)
        if rank not in plan.recipients:
            member.machine.fire("restored", ctx.stamp)
            member.last_heartbeat_ts = record.ts
    _maybe_restored(ctx)


def _state_transferred(ctx: Context, record: StateTransferred) -> None:
    state = ctx.state
    view = state.ranks[record.rank]
    view.machine.fire("restored", ctx.stamp)
    view.last_heartbeat_ts = record.ts
    state.needs_state.discard(record.rank)
    _maybe_restored(ctx)


def _rank_finished(ctx: Context, record: RankFinished) -> None:
    ctx.state.ranks[record.rank].machine.fire("finish", ctx.stamp)
    _maybe_close_incidents(ctx)  # a rank replaced after the last step resumes by finishing


def _job_finished(ctx: Context, record: JobFinished) -> None:
    job = ctx.state.job
    if record.status == "completed":
        job.fire("complete", ctx.stamp)
    elif job.state != "failed":
        job.fire("fail", ctx.stamp)


HANDLERS: dict[type[Envelope], Callable[[Context, Any], None]] = {
    RankJoined: _rank_joined,
    SpareReady: _spare_ready,
    Heartbeat: _heartbeat,
    StepCompleted: _step_completed,
    RankExited: _rank_exited,
    CollectiveError: _collective_error,
    HeartbeatMissed: _heartbeat_missed,
    StallSuspected: _stall_suspected,
    HealthReport: _health_report,
    SpareActivated: _spare_activated,
    ReplacementSpawned: _replacement_spawned,
    RankRegrouped: _rank_regrouped,
    StateTransferred: _state_transferred,
    RankFinished: _rank_finished,
    JobFinished: _job_finished,
}


# ------------------------------------------------------------------ recovery steps


def _clear_suspicion(ctx: Context, view: RankView) -> None:
    if view.machine.state == "suspect":
        view.machine.fire("clear", ctx.stamp)


def _fail(ctx: Context, rank: int, failure_ts: float, reason: str) -> None:
    """Open an incident for a rank that is alive in the current generation: isolate it,
    choose its replacement and plan the next generation, in one decide step."""
    state = ctx.state
    view = state.ranks[rank]
    if view.machine.state not in (*ALIVE, "pending"):
        return  # already being replaced, or finished: nothing new to decide
    if state.job.state in ("completed", "failed", "fallback"):
        raise Rejected(f"the job is {state.job.state}")
    if any(v.machine.state == "finished" for v in state.ranks.values()):
        return  # every step is committed everywhere: the job is ending, nothing to recover
    incident = Incident(
        incident_id=f"{state.job_id}-incident-{len(state.incidents) + 1}",
        failed_rank=rank,
        failure_ts=min(failure_ts, ctx.record.ts),
        generation=state.generation + 1,
        machine=IncidentMachine(f"incident:{len(state.incidents) + 1}"),
        committed_before=state.max_committed(),
        detected=ctx.stamp,
        reason=reason,
    )
    state.incidents.append(incident)
    view.machine.fire("fail", ctx.stamp)
    ctx.emit(IsolateRank, rank=rank, pid=view.pid, reason=reason, incident_id=incident.incident_id)
    view.machine.fire("isolate", ctx.stamp)
    incident.machine.fire("isolate", ctx.stamp)
    state.job.fire("isolate", ctx.stamp)

    state.generation += 1
    _choose_replacement(ctx, rank, incident.incident_id)
    view.committed_step = -1
    state.needs_state.add(rank)
    state.resume_planned = False
    for member in state.ranks.values():
        member.regrouped_step = None
        member.waiting = False
        if member.machine.state in ALIVE and member.machine.state != "paused":
            member.machine.fire("pause", ctx.stamp)
            member.last_heartbeat_ts = ctx.record.ts  # silence is timed from the regroup on
    for open_incident in state.open_incidents():
        open_incident.generation = state.generation
    ctx.emit(
        RegroupPlanned,
        members=sorted(state.ranks),
        replaced=sorted(state.needs_state),
        incident_id=incident.incident_id,
    )
    state.job.fire("regroup", ctx.stamp)


def _choose_replacement(ctx: Context, rank: int, incident_id: str) -> None:
    """A ready spare if there is one, else a fresh process; the rank's pid becomes the spare's
    at once, so that its death before it takes over is recognised."""
    state, view = ctx.state, ctx.state.ranks[rank]
    spare_id = planner.choose_spare(state)
    if spare_id is not None:
        ctx.emit(AssignSpare, rank=rank, spare_id=spare_id, incident_id=incident_id)
        state.spares[spare_id].status = "assigned"
        view.pid = state.spares[spare_id].pid
    else:
        ctx.emit(SpawnReplacement, rank=rank, incident_id=incident_id)
        view.pid = None


def _replacement_ready(ctx: Context, rank: int, pid: int, *, warm: bool) -> None:
    """The replacement process holds the rank now. A warm spare heartbeats at once; a fresh
    process gets the start-up grace before its silence counts."""
    state, view = ctx.state, ctx.state.ranks[rank]
    if view.machine.state != "isolated":
        if view.pid == pid:
            return  # the replacement's own regroup record came first
        raise Rejected(f"rank {rank} is {view.machine.state}, not waiting for a replacement")
    view.pid = pid
    view.last_heartbeat_ts = ctx.record.ts
    config = state.config
    view.grace_until_ts = None if warm or config is None else ctx.record.ts + config.startup_grace_s
    view.machine.fire("replace", ctx.stamp)
    view.machine.fire("rejoin", ctx.stamp)
    for incident in ctx.state.open_incidents():
        if incident.failed_rank == rank and incident.machine.can("replacement_ready"):
            incident.machine.fire("replacement_ready", ctx.stamp)


def _maybe_restored(ctx: Context) -> None:
    state = ctx.state
    if any(v.machine.state == "restoring" for v in state.ranks.values()):
        return
    for incident in state.open_incidents():
        if incident.machine.can("restored"):
            incident.machine.fire("restored", ctx.stamp)
    if state.job.state == "restoring":
        state.job.fire("resume", ctx.stamp)


def _maybe_close_incidents(ctx: Context) -> None:
    state = ctx.state
    if state.job.state != "resuming":
        return
    resume_steps = {i.resume_step for i in state.open_incidents()}
    if None in resume_steps or not resume_steps:
        return
    resume_step = max(s for s in resume_steps if s is not None)
    if any(
        v.committed_step <= resume_step and v.machine.state != "finished"
        for v in state.ranks.values()
    ):
        return
    for incident in state.open_incidents():
        incident.machine.fire("resumed", ctx.stamp)
        incident.machine.fire("close", ctx.stamp)
        ctx.emit(
            IncidentClosed,
            incident_id=incident.incident_id,
            failed_rank=incident.failed_rank,
            rto_s=round(ctx.record.ts - incident.failure_ts, 6),
            rpo_steps=max(0, incident.committed_before - resume_step),
            recomputed_steps=max(0, incident.committed_before + 1 - resume_step),
            phases=phase_durations(incident),
        )
    state.job.fire("recovered", ctx.stamp)


def phase_durations(incident: Incident) -> dict[str, float]:
    """Seconds spent reaching each phase from the previous one (failure -> detected -> …)."""
    durations: dict[str, float] = {}
    previous = incident.failure_ts
    for phase in PHASES:
        stamp = incident.detected if phase == "detected" else incident.machine.entered(phase)
        if stamp is None:
            continue
        durations[phase] = round(max(0.0, stamp.ts - previous), 6)
        previous = max(previous, stamp.ts)
    return durations


def _latest_incident_id(state: EngineState) -> str | None:
    return state.incidents[-1].incident_id if state.incidents else None
