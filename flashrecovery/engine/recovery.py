"""What a failure sets in motion, as pure steps of the decide call: open an incident, isolate
the rank, choose its replacement, plan the next generation, plan the restore, close the incident
once every member committed past the resume step. Also the guards that end a job instead of
recovering it again (a crash loop, too many incidents) and the care of the spare pool.
"""

from __future__ import annotations

from flashrecovery.engine import planner
from flashrecovery.engine.context import Context
from flashrecovery.engine.state import EngineState, Incident, RankView, SpareStatus, SpareView
from flashrecovery.errors import Rejected
from flashrecovery.records import (
    AssignSpare,
    AwaitNode,
    FailJob,
    FallbackToCheckpoint,
    IncidentClosed,
    IsolateNode,
    IsolateRank,
    RegroupPlanned,
    ResumePlanned,
    RetireSpare,
    SpawnReplacement,
)
from flashrecovery.statemachines.base import Trigger
from flashrecovery.statemachines.incident import PHASES, IncidentMachine, IncidentState
from flashrecovery.statemachines.job import JobState
from flashrecovery.statemachines.rank import ALIVE, RankState


def clear_suspicion(ctx: Context, view: RankView) -> None:
    if view.machine.state == RankState.SUSPECT:
        ctx.fire(view.machine, Trigger.CLEAR)


def fail(ctx: Context, rank: int, failure_ts: float, reason: str, fatal: bool = False) -> None:
    """Open an incident for a rank that is alive in the current generation; ``fatal``: its
    process said the script cannot run (a ScriptError), so the job fails in it."""
    fail_ranks(ctx, [rank], failure_ts, reason, fatal=fatal)


def fail_node(ctx: Context, node: int, failure_ts: float, reason: str) -> None:
    """A node is lost with its agent: its spares leave the pool, and its ranks are isolated
    together and replaced together, in one incident, by spares of other nodes."""
    state = ctx.state
    view = state.nodes[node]
    if view.lost:
        return
    view.lost = True
    for spare in state.spares.values():
        if spare.node == node and spare.status == SpareStatus.READY:
            spare.status = SpareStatus.GONE
    held = sorted(state.node_ranks.get(node, ()))
    ctx.emit(IsolateNode, node=node, pid=view.pid, ranks=held, reason=reason)
    # A rank already isolated whose replacement was to come from this node needs another.
    for rank in held:
        if state.ranks[rank].machine.state is not RankState.ISOLATED:
            continue
        incident = _incident_of(state, rank)
        if incident is not None:
            place(ctx, [rank], incident.incident_id)
    fail_ranks(ctx, held, failure_ts, reason, node=node)


def fail_ranks(
    ctx: Context,
    ranks: list[int],
    failure_ts: float,
    reason: str,
    node: int | None = None,
    fatal: bool = False,
    verdict: str | None = None,
) -> None:
    """Open one incident for the ranks that are alive in the current generation: isolate
    them, then either end the job (a guard tripped, or ``verdict`` says why nothing can
    recover it) or choose their replacements and plan the next generation, in one decide
    step."""
    state = ctx.state
    ranks = [r for r in ranks if state.ranks[r].machine.state in (*ALIVE, RankState.PENDING)]
    if not ranks:
        return  # already being replaced, or finished: nothing new to decide
    if state.job.state in (JobState.COMPLETED, JobState.FAILED, JobState.FALLBACK):
        raise Rejected(f"the job is {state.job.state}")
    if state.rank_census[RankState.FINISHED]:
        return  # every step is committed everywhere: the job is ending, nothing to recover
    number = len(state.incidents) + 1
    incident = Incident(
        incident_id=f"{state.job_id}-incident-{number}",
        failed_rank=ranks[0],
        failure_ts=min(failure_ts, ctx.record.ts),
        generation=state.generation + 1,
        machine=IncidentMachine(f"incident:{number}"),
        committed_before=state.max_committed(),
        detected=ctx.stamp,
        reason=reason,
        failed_ranks=ranks,
        failed_node=node,
    )
    state.incidents.append(incident)
    for rank in ranks:
        view = state.ranks[rank]
        ctx.fire(view.machine, Trigger.FAIL)
        ctx.emit(
            IsolateRank,
            rank=rank,
            pid=view.pid,
            reason=reason,
            incident_id=incident.incident_id,
            node=view.node,
        )
        ctx.fire(view.machine, Trigger.ISOLATE)
    ctx.fire(incident.machine, Trigger.ISOLATE)
    ctx.fire(state.job, Trigger.ISOLATE)
    if _guard_tripped(ctx, ranks, reason, incident, fatal, verdict):
        return

    state.generation += 1
    state.step_scores.restart(set(ranks))  # new processes, new timings: scored afresh
    moved = _move_store(state)  # first: the replacements are told where they meet
    place(ctx, ranks, incident.incident_id)
    for rank in ranks:
        state.set_committed(rank, None)
        state.needs_state.add(rank)
    state.resume_planned = False
    state.resume_step = None
    state.pause_members(ctx.stamp)  # silence is timed from the regroup on
    for open_incident in state.open_incidents():
        open_incident.generation = state.generation
    ctx.emit(
        RegroupPlanned,
        members=sorted(state.ranks),
        replaced=sorted(state.needs_state),
        incident_id=incident.incident_id,
        store=moved,
    )
    ctx.fire(state.job, Trigger.REGROUP)


def _move_store(state: EngineState) -> str | None:
    """Where the next generation's store is, if it must move: the node holding the current
    one was lost, so the lowest node alive with a store of its own holds it from now on."""
    if state.store_node is None or not state.node_lost(state.store_node):
        return None
    alive = [v for n, v in sorted(state.nodes.items()) if not v.lost and v.store is not None]
    if not alive:
        return None  # nowhere to meet: the ranks' regroup times out and the job says so
    state.store_node, state.meeting = alive[0].node, alive[0].store
    return state.meeting


def _guard_tripped(
    ctx: Context,
    ranks: list[int],
    error: str,
    incident: Incident,
    fatal: bool = False,
    given_up: str | None = None,
) -> bool:
    """Count the failure of each rank at the job's committed step; fail the job instead of
    recovering when one keeps failing there, when the job has had its allowed incidents, when
    the failure is ``fatal`` (the script cannot run: no replacement would do better), or when
    the caller ``given_up`` (why)."""
    state, config = ctx.state, ctx.state.config
    assert config is not None
    step = state.max_committed()
    for r in ranks:
        if not state.ranks[r].untried_spare:  # a spare that never took over is not the rank
            state.failures[(r, step)] += 1
    rank = max(ranks, key=lambda r: state.failures[(r, step)])
    failures = state.failures[(rank, step)]
    if given_up is not None:
        verdict = given_up
    elif fatal:
        verdict = f"rank {rank} ended with an error no replacement would do better on"
    elif failures and failures >= config.max_replacements:
        where = "before its first step" if step < 0 else f"at committed step {step}"
        verdict = f"rank {rank} failed {failures} times {where} (--max-replacements)"
    elif config.max_incidents is not None and len(state.incidents) > config.max_incidents:
        verdict = f"incident {len(state.incidents)} exceeds --max-incidents {config.max_incidents}"
    else:
        return False
    fail_job(ctx, rank, failures, error, verdict, incident.incident_id)
    return True


def fail_job(
    ctx: Context, rank: int, failures: int, error: str, verdict: str, incident_id: str
) -> None:
    """End the job instead of recovering it: FailJob, and every open incident fails with it."""
    state = ctx.state
    ctx.emit(
        FailJob,
        rank=rank,
        step=state.max_committed(),
        failures=failures,
        last_error=error,
        reason=verdict,
        incident_id=incident_id,
    )
    for open_incident in state.open_incidents():
        ctx.fire(open_incident.machine, Trigger.FAIL)
    ctx.fire(state.job, Trigger.FAIL)
    state.verdict = f"{verdict}; last error: {error}"


def replacement_died(ctx: Context, rank: int, error: str, fatal: bool = False) -> None:
    """The process chosen to replace ``rank`` died before it took over: it counts as another
    failure of the rank (a script that can't start loops here), then try again."""
    incident = _incident_of(ctx.state, rank)
    if incident is None:  # the job failed already: nothing is replaced any more
        ctx.state.fenced += 1
        return
    if not _guard_tripped(ctx, [rank], error, incident, fatal):
        place(ctx, [rank], incident.incident_id)


def _incident_of(state: EngineState, rank: int) -> Incident | None:
    """The newest open incident that replaces ``rank`` (None once the job failed)."""
    return next((i for i in reversed(state.open_incidents()) if rank in i.failed_ranks), None)


def place(ctx: Context, ranks: list[int], incident_id: str) -> None:
    """Choose each rank's replacement: a ready spare of any node, else a fresh process on the
    rank's own node if that node lives; ranks with neither wait for a node (AwaitNode)."""
    state = ctx.state
    spares = planner.choose_spares(state, ranks, ctx.record.ts)
    homeless = [
        rank
        for rank, spare_id in zip(ranks, [*spares, *[None] * len(ranks)], strict=False)
        if not replace_rank(ctx, rank, incident_id, spare_id)
    ]
    if not homeless:
        return
    config = state.config
    assert config is not None
    for rank in homeless:
        state.awaiting_node[rank] = incident_id
    if state.awaiting_node_since is None:
        state.awaiting_node_since = ctx.record.ts
    ctx.emit(AwaitNode, ranks=homeless, node_wait_s=config.node_wait_s, incident_id=incident_id)


def place_waiting(ctx: Context) -> None:
    """A spare became ready: it takes the longest-waiting rank of a lost node, if any."""
    state = ctx.state
    if not state.awaiting_node:
        return
    rank = min(state.awaiting_node)
    incident_id = state.awaiting_node.pop(rank)
    if not state.awaiting_node:
        state.awaiting_node_since = None
    place(ctx, [rank], incident_id)


def node_wait_expired(ctx: Context, ranks: list[int], waited_s: float) -> None:
    """Ranks of a lost node waited --node-wait for capacity that never came: the job fails."""
    state = ctx.state
    still = sorted(r for r in ranks if r in state.awaiting_node)
    if not still or state.job.state in (JobState.COMPLETED, JobState.FAILED):
        return
    incident_id = state.awaiting_node[still[0]]
    incident = next(i for i in state.incidents if i.incident_id == incident_id)
    verdict = (
        f"no capacity: rank(s) {', '.join(map(str, still))} found no spare and no node joined "
        f"within {waited_s:.0f}s (--node-wait)"
    )
    state.awaiting_node.clear()
    state.awaiting_node_since = None
    fail_job(ctx, still[0], 1, incident.reason, verdict, incident_id)


def replace_rank(ctx: Context, rank: int, incident_id: str, spare_id: int | None) -> bool:
    """Hand the rank to the spare, else to a fresh process on the rank's node if it lives
    (False: neither); the rank's pid becomes the spare's at once, so that its death before it
    takes over is recognised."""
    state = ctx.state
    view = state.ranks[rank]
    if spare_id is not None:
        spare = state.spares[spare_id]
        ctx.emit(
            AssignSpare,
            rank=rank,
            spare_id=spare_id,
            incident_id=incident_id,
            node=spare.node,
            store=state.meeting,
        )
        spare.status = SpareStatus.ASSIGNED
        state.set_pid(rank, spare.pid)
        state.set_node(rank, spare.node)
        view.untried_spare = True
        return True
    state.set_pid(rank, None)
    view.untried_spare = False
    if state.node_lost(view.node):
        return False
    ctx.emit(
        SpawnReplacement, rank=rank, incident_id=incident_id, node=view.node, store=state.meeting
    )
    return True


def replacement_ready(ctx: Context, rank: int, pid: int, *, warm: bool) -> None:
    """The replacement process holds the rank now. A warm spare heartbeats at once; a fresh
    process gets the start-up grace before its silence counts."""
    state, view = ctx.state, ctx.state.ranks[rank]
    if view.machine.state != RankState.ISOLATED:
        if view.pid == pid:
            return  # the replacement's own regroup record came first
        raise Rejected(f"rank {rank} is {view.machine.state}, not waiting for a replacement")
    state.set_pid(rank, pid)
    config = state.config
    grace = None if warm or config is None else ctx.record.ts + config.startup_grace_s
    state.watch_from(rank, ctx.record.ts, grace)
    ctx.fire(view.machine, Trigger.REPLACE)
    ctx.fire(view.machine, Trigger.REJOIN)
    for incident in state.open_incidents():
        if incident.failed_rank == rank and incident.machine.can(Trigger.REPLACE):
            ctx.fire(incident.machine, Trigger.REPLACE)


def plan_resume(ctx: Context) -> None:
    """Every member regrouped: name the resume step and a donor per shard, or fall back."""
    state = ctx.state
    for incident in state.open_incidents():
        if incident.machine.can(Trigger.REGROUP):
            ctx.fire(incident.machine, Trigger.REGROUP)
    plan = planner.plan_resume(state)
    if isinstance(plan, planner.NoReplica):
        if state.checkpoint is None:
            ctx.emit(
                FallbackToCheckpoint,
                reason=f"no healthy replica holds shard(s) {plan.shards} and no complete "
                "checkpoint exists (flashrecovery run --checkpoint-dir)",
                shards=plan.shards,
                incident_id=latest_incident_id(state),
            )
            for incident in state.open_incidents():
                ctx.fire(incident.machine, Trigger.FALL_BACK)
            ctx.fire(state.job, Trigger.FALL_BACK)
            return
        step, path = state.checkpoint
        ctx.emit(
            FallbackToCheckpoint,
            reason=f"no healthy replica holds shard(s) {plan.shards}",
            shards=plan.shards,
            step=step,
            path=path,
            incident_id=latest_incident_id(state),
        )
        # A restore like any other whose every member is a recipient, from the checkpoint.
        for incident in state.open_incidents():
            incident.checkpoint_step = step
        plan = planner.ResumePlan(step, {}, sorted(state.ranks), {})
        for rank in plan.recipients:
            state.needs_state.add(rank)
            state.set_committed(rank, None)  # what it holds is dropped for the checkpoint
    else:
        ctx.emit(
            ResumePlanned,
            resume_step=plan.resume_step,
            donors=plan.donors,
            recipients=plan.recipients,
            stripes=plan.stripes,
            incident_id=latest_incident_id(state),
        )
    state.resume_planned = True
    state.resume_step = plan.resume_step
    for incident in state.open_incidents():
        incident.resume_step = plan.resume_step
    ctx.fire(state.job, Trigger.BEGIN_RESTORE)
    state.resume_members(ctx.stamp, plan.resume_step, plan.recipients)
    maybe_restored(ctx)


def current_resume_step(state: EngineState) -> int:
    if state.resume_step is None:
        raise Rejected("no resume plan in this generation")
    return state.resume_step


def maybe_restored(ctx: Context) -> None:
    state = ctx.state
    if state.rank_census[RankState.RESTORING]:
        return
    for incident in state.open_incidents():
        if incident.machine.can(Trigger.END_RESTORE):
            ctx.fire(incident.machine, Trigger.END_RESTORE)
    if state.job.state == JobState.RESTORING:
        ctx.fire(state.job, Trigger.END_RESTORE)


def maybe_close_incidents(ctx: Context) -> None:
    state = ctx.state
    if state.job.state != JobState.RESUMING or state.resume_step is None:
        return
    resume_step = state.resume_step
    if state.committed.counts and state.committed.floor() <= resume_step:
        return  # some rank still training has not committed past the resume step
    for incident in state.open_incidents():
        ctx.fire(incident.machine, Trigger.RESUME)
        ctx.fire(incident.machine, Trigger.CLOSE)
        ctx.emit(
            IncidentClosed,
            incident_id=incident.incident_id,
            failed_rank=incident.failed_rank,
            failed_ranks=incident.failed_ranks if incident.failed_node is not None else [],
            failed_node=incident.failed_node,
            rto_s=round(ctx.record.ts - incident.failure_ts, 6),
            rpo_steps=max(0, incident.committed_before - resume_step),
            recomputed_steps=max(0, incident.committed_before + 1 - resume_step),
            phases=phase_durations(incident),
        )
    ctx.fire(state.job, Trigger.RESUME)


def phase_durations(incident: Incident) -> dict[str, float]:
    """Seconds spent reaching each phase from the previous one (failure -> detected -> …)."""
    durations: dict[str, float] = {}
    previous = incident.failure_ts
    for phase in PHASES:
        stamp = (
            incident.detected
            if phase == IncidentState.DETECTED
            else incident.machine.entered(phase)
        )
        if stamp is None:
            continue
        durations[str(phase)] = round(max(0.0, stamp.ts - previous), 6)
        previous = max(previous, stamp.ts)
    return durations


def latest_incident_id(state: EngineState) -> str | None:
    return state.incidents[-1].incident_id if state.incidents else None


# ------------------------------------------------------------------ the spare pool


def retire_spare(ctx: Context, spare: SpareView, reason: str) -> None:
    """An idle spare died or went silent: out of the pool (never assigned), and replaced."""
    spare.status = SpareStatus.GONE
    ctx.emit(RetireSpare, spare_id=spare.spare_id, pid=spare.pid, reason=reason, node=spare.node)


def spare_lost_unready(
    ctx: Context, spare_id: int, pid: int, how: str, node: int, fatal: bool = False
) -> None:
    """A spare died before it was ever ready. Replaced as long as that has not happened
    max_replacements times in the job: a script that can't start must not respawn for ever."""
    state, config = ctx.state, ctx.state.config
    assert config is not None
    state.spares_lost_unready += 1
    refill = state.spares_lost_unready < config.max_replacements and not fatal
    reason = f"exited before it was ready ({how})"
    if fatal:
        reason += ": the script cannot run, no more spares are started"
    elif not refill:
        reason += (
            f"; {state.spares_lost_unready} spares did so: no more are started "
            "(--max-replacements), the job goes on without"
        )
    ctx.emit(RetireSpare, spare_id=spare_id, pid=pid, reason=reason, refill=refill, node=node)
