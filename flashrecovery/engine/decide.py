"""The decide step: (state, event) -> decisions. No clock, no I/O, nothing random.

Each record type has one handler here that checks the record against what the job's own records
established (a record that contradicts them is rejected with its reason, never believed) and
updates the state; what a failure sets in motion lives in recovery.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashrecovery.engine import integrity, links, planner, recovery, stragglers
from flashrecovery.engine.context import Context
from flashrecovery.engine.state import EngineState, NodeView, RankView, SpareStatus, SpareView
from flashrecovery.errors import IllegalTransition, Rejected
from flashrecovery.records import (
    AgentExited,
    CheckpointLoaded,
    CheckpointSaved,
    CollectiveError,
    Decision,
    EngineLease,
    Envelope,
    HealthReport,
    Heartbeat,
    HeartbeatMissed,
    JobFinished,
    JobOutcome,
    JobStarted,
    LinkSample,
    NodeHeartbeat,
    NodeJoined,
    NodeMissed,
    NodeWaitExpired,
    RankExited,
    RankFinished,
    RankJoined,
    RankRegrouped,
    ReplacementSpawned,
    RestoreRejected,
    SpareActivated,
    SpareHeartbeat,
    SpareMissed,
    SpareReady,
    StallSuspected,
    StateDigest,
    StateTransferred,
    StepCompleted,
    StepNonFinite,
    StepRetried,
    StragglerCleared,
    StragglerFound,
    StragglerPolicy,
)
from flashrecovery.statemachines.base import Trigger
from flashrecovery.statemachines.job import RECOVERING, JobState
from flashrecovery.statemachines.rank import ALIVE, RankMachine, RankState

# Records a member sends about itself in its generation; older generations are fenced.
FENCED_TYPES = (
    RankJoined,
    Heartbeat,
    StepCompleted,
    StepNonFinite,
    StepRetried,
    StateDigest,
    RestoreRejected,
    CollectiveError,
    RankRegrouped,
    StateTransferred,
    CheckpointLoaded,
    HealthReport,
    RankFinished,
    HeartbeatMissed,
    StallSuspected,
)


def decide(state: EngineState, position: int, record: Envelope) -> list[Decision]:
    """Apply one event at its log position and return the decisions it causes.

    A record that can't apply (wrong job, unknown rank, contradicts the job's records) is
    counted in ``state.rejected`` with its reason and produces nothing; a stale generation's
    record is counted in ``state.fenced``. A transition the engine's own logic gets wrong is an
    engine fault, kept in ``state.engine_faults`` for the loop to report as such.
    """
    state.position = max(state.position, position)
    ctx = Context(state, position, record)
    try:
        _apply(ctx)
    except Rejected as exc:
        state.reject(f"{record.type}: {exc}")
        return []
    except IllegalTransition as exc:
        state.engine_faults.append(f"{record.type} at position {position}: {exc}")
        return []
    return ctx.decisions


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
        if isinstance(record, Heartbeat):
            _beat_before_the_plan(state, record)
        if isinstance(record, StepCompleted):
            state.late_commit = max(state.late_commit, record.step)
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
    state.meeting = record.store
    state.step_scores = stragglers.StepScores(record.straggler_steps, record.straggler_ratio)
    for r in range(record.world_size):
        state.ranks[r] = RankView(RankMachine(f"rank:{r}", census=state.rank_census))
        state.set_node(r, r // record.nproc_per_node)  # laid out node by node
        state.set_committed(r, -1)
        state.watch_from(r, None, record.ts + record.startup_grace_s)


def _rank_joined(ctx: Context, record: RankJoined) -> None:
    state = ctx.state
    shards = state.config.shards if state.config else 1
    if record.shard >= shards:
        raise Rejected(f"shard {record.shard} is outside the job's {shards} shard(s)")
    view = state.ranks[record.rank]
    ctx.require(view.machine, Trigger.JOIN, f"rank {record.rank}")
    ctx.fire(view.machine, Trigger.READY)
    state.set_pid(record.rank, record.pid)
    view.host, view.shard = record.host, record.shard
    state.heard_from(record.rank, record.ts)
    if state.job.state == JobState.STARTING and (
        state.rank_census[RankState.HEALTHY] == state.world_size
    ):
        ctx.fire(state.job, Trigger.RUN)


def _node_joined(ctx: Context, record: NodeJoined) -> None:
    state = ctx.state
    if record.node in state.nodes:
        raise Rejected(f"node {record.node} has joined already (a node comes back as a new one)")
    state.nodes[record.node] = NodeView(
        record.node,
        record.pid,
        record.host,
        record.ts,
        store=record.store,
        presence=record.presence,
        probe=record.probe,
    )
    if record.store is not None and record.store == state.meeting:
        state.store_node = record.node  # the node holding the meeting store (node 0's, usually)


def _node_heartbeat(ctx: Context, record: NodeHeartbeat) -> None:
    state = ctx.state
    node = state.nodes.get(record.node)
    if node is None or node.pid != record.pid or node.lost:
        state.fenced += 1  # not joined yet, an old agent, or a node already given up
        return
    node.last_heartbeat_ts = record.ts
    # Each carried beat as if it came alone, at the agent's time: the agent vouches that the
    # process beat within this interval. So a rank's silence is timed on its node's record, and
    # a dying node's ranks fall silent with it, never a beat ahead of it (detectors.py).
    for beat in record.beats:
        at_node = beat.model_copy(update={"ts": record.ts})
        inner = Context(state, ctx.position, at_node, decisions=ctx.decisions)
        try:
            _apply(inner)
        except Rejected as exc:
            state.reject(f"{beat.type} in {record.type}: {exc}")
    for sample in record.links:
        state.links.add(record.node, sample)
        _peer_heard(state, sample, record.ts)
    if record.links:
        _score_links(ctx, record)


def _peer_heard(state: EngineState, sample: LinkSample, ts: float) -> None:
    """Whether a peer's probes of the node came back this interval (detectors.silent_nodes
    gives a node its peers still hear the log's hold on top of its silence limit)."""
    view = state.nodes.get(sample.peer)
    if view is None or not sample.probes:
        return
    if sample.late < sample.probes:
        view.heard_by_peer_ts = max(view.heard_by_peer_ts or ts, ts)
    else:
        view.unheard_by_peer_ts = max(view.unheard_by_peer_ts or ts, ts)


def _score_links(ctx: Context, record: NodeHeartbeat) -> None:
    """Name a node whose links slow the job (engine/links.py), once until they heal; replace
    its ranks when the job's policy says so and spares can take them all. Only while the job
    runs: a recovery, or the job's end, turns links over for reasons of its own."""
    state = ctx.state
    assert state.config is not None
    if state.job.state is not JobState.RUNNING or state.rank_census[RankState.FINISHED]:
        state.links.clear()  # scored afresh once it runs again
        return
    quiet = links.HEARD_INTERVALS * state.config.heartbeat_interval_s

    def heard(node: int) -> bool:
        view = state.nodes.get(node)
        return view is not None and not view.lost and record.ts - view.last_heartbeat_ts <= quiet

    for node in sorted({record.node, *(sample.peer for sample in record.links)}):
        if node in state.stragglers:
            if (share := links.healed(state.links, node, heard)) is not None:
                state.stragglers.discard(node)
                ctx.emit(
                    StragglerCleared,
                    node=node,
                    late_ratio=round(share, 4),
                    reason=f"node {node}'s links lose or delay {share:.0%} of their probes "
                    f"again (under {links.GOOD_RATIO:.1%})",
                )
        elif heard(node) and (found := links.straggler(state.links, node, heard)):
            _straggler_found(ctx, found)


def _straggler_found(ctx: Context, found: links.Straggler) -> None:
    state = ctx.state
    assert state.config is not None
    state.stragglers.add(found.node)
    held = sorted(state.node_ranks.get(found.node, ()))
    free = [s for s in planner.fresh_spares(state, ctx.record.ts) if s.node != found.node]
    policy = state.config.straggler_policy
    replace = policy is StragglerPolicy.REPLACE and bool(held) and len(free) >= len(held)
    peers = ", ".join(map(str, found.peers))
    why = (
        f"node {found.node}'s links lose or delay {found.late_ratio:.0%} of their probes "
        f"(to node(s) {peers}), while the links between its peers do not"
    )
    if replace:
        outcome = "replaced (--straggler-policy replace)"
    elif policy is StragglerPolicy.REPLACE:
        outcome = f"named only: {len(free)} spare(s) free for its {len(held)} rank(s)"
    else:
        outcome = "named only (--straggler-policy report)"
    ctx.emit(
        StragglerFound,
        node=found.node,
        ranks=held,
        late_ratio=found.late_ratio,
        peers=found.peers,
        replaced=replace,
        reason=f"{why}: {outcome}",
    )
    if replace:
        recovery.fail_node(
            ctx, found.node, ctx.record.ts, f"node {found.node} slows the job: {why}"
        )


def _node_missed(ctx: Context, record: NodeMissed) -> None:
    if record.node not in ctx.state.nodes:
        raise Rejected(f"node {record.node} never joined")
    reason = f"node {record.node} lost: no heartbeat from its agent for {record.silent_s:.2f}s"
    recovery.fail_node(ctx, record.node, record.last_seen_ts, reason)


def _agent_exited(ctx: Context, record: AgentExited) -> None:
    view = ctx.state.nodes.get(record.node)
    if view is None:
        raise Rejected(f"node {record.node} never joined")
    if view.pid != record.pid or view.lost or ctx.state.node_lost(record.observer):
        # an earlier agent of that node, a node given up already, or an observer given up:
        # a node cut off sees every peer gone, and must not take them down with it
        ctx.state.fenced += 1
        return
    reason = f"node {record.node} lost: its agent exited (node {record.observer} saw it go)"
    recovery.fail_node(ctx, record.node, record.ts, reason)


def _node_wait_expired(ctx: Context, record: NodeWaitExpired) -> None:
    recovery.node_wait_expired(ctx, record.ranks, record.waited_s)


def _spare_ready(ctx: Context, record: SpareReady) -> None:
    state = ctx.state
    if record.spare_id in state.spares:
        raise Rejected(f"spare {record.spare_id} is already known")
    if state.node_lost(record.node):
        state.fenced += 1  # its node was given up: its agent tears it down
        return
    state.spares[record.spare_id] = SpareView(
        record.spare_id, record.pid, record.host, last_heartbeat_ts=record.ts, node=record.node
    )
    recovery.place_waiting(ctx)


def _spare_heartbeat(ctx: Context, record: SpareHeartbeat) -> None:
    spare = ctx.state.spares.get(record.spare_id)
    if spare is None or spare.pid != record.pid:
        ctx.state.fenced += 1  # not ready yet, or an old process of that spare id
        return
    spare.last_heartbeat_ts = record.ts


def _spare_missed(ctx: Context, record: SpareMissed) -> None:
    spare = ctx.state.spares.get(record.spare_id)
    if spare is None:
        raise Rejected(f"spare {record.spare_id} never reported ready")
    if spare.status == SpareStatus.READY:
        recovery.retire_spare(ctx, spare, f"no heartbeat for {record.silent_s:.2f}s")


def _heartbeat(ctx: Context, record: Heartbeat) -> None:
    state = ctx.state
    view = state.ranks[record.rank]
    if view.machine.state == RankState.PENDING and view.pid is None:
        state.set_pid(record.rank, record.pid)  # alive before it could join: known from now on
    if view.pid != record.pid:
        state.fenced += 1  # an old process of this rank id
        return
    state.heard_from(record.rank, record.ts)  # alive: the grace is over
    state.set_waiting(record.rank, record.waiting)
    if not _stalled_by(state, view):
        recovery.clear_suspicion(ctx, view)


def _beat_before_the_plan(state: EngineState, record: Heartbeat) -> None:
    """A member the new generation's plan has not reached yet (an engine taking over wrote it
    late, or the log held it) still lives: its beat times its silence, and says nothing else
    (its step and wait belong to the generation it is leaving)."""
    view = state.ranks[record.rank]
    if view.pid == record.pid and view.machine.state in ALIVE:
        state.heard_from(record.rank, record.ts)


def _stalled_by(state: EngineState, view: RankView) -> bool:
    """A heartbeat proves life, not progress: a suspect behind its peers, or outside commit()
    while a peer waits inside it, stays suspect."""
    behind = view.committed_step < state.max_committed()
    return behind or (not view.waiting and state.waiting > 0)


def _member_holding_state(state: EngineState, rank: int) -> RankView:
    view = state.ranks[rank]
    if view.machine.state not in ALIVE or rank in state.needs_state:
        raise Rejected(f"rank {rank} is {view.machine.state}, not a member holding state")
    return view


def _step_completed(ctx: Context, record: StepCompleted) -> None:
    """Believed only where the commit protocol allows it: a member commits each step once, in
    order, and only a step every member voted on, so never more than one past the slowest."""
    state = ctx.state
    view = _member_holding_state(state, record.rank)
    if record.step <= view.committed_step:
        raise Rejected(f"rank {record.rank} committed step {record.step} already")
    if record.step > state.committed.floor() + 1:
        raise Rejected(
            f"step {record.step} can't be committed: a member has committed only up to "
            f"{state.committed.floor()}, and a step commits only when every member voted"
        )
    state.set_committed(record.rank, record.step)
    view.last_step_ts = state.last_step_ts = record.ts
    state.set_waiting(record.rank, False)
    state.step_durations.append(record.duration_s)
    recovery.clear_suspicion(ctx, view)
    recovery.maybe_close_incidents(ctx)
    if record.compute_s is not None and state.job.state is JobState.RUNNING:
        scored = state.step_scores.add(record.rank, record.step, record.compute_s, state.world_size)
        for change in scored:
            _rank_straggler(ctx, change)


def _rank_straggler(ctx: Context, change: stragglers.Change) -> None:
    """A rank whose steps are steadily slower than its peers' is named, and replaced when the
    job's policy says so and a fresh spare can take its place (an incident like a failure's:
    its step in flight is computed again, no committed step is lost); or it is cleared."""
    state = ctx.state
    assert state.config is not None
    view = state.ranks[change.rank]
    slower = f"rank {change.rank}'s steps take {change.slowdown:.2f}x its peers' median"
    window = f"over its last {state.config.straggler_steps} steps"
    if not change.found:
        ctx.emit(
            StragglerCleared,
            node=view.node,
            rank=change.rank,
            slowdown=change.slowdown,
            reason=f"{slower} {window} (under {(1 + state.config.straggler_ratio) / 2:.2f}x)",
        )
        return
    policy = state.config.straggler_policy
    free = planner.fresh_spares(state, ctx.record.ts)
    replace = policy is StragglerPolicy.REPLACE and bool(free)
    if replace:
        outcome = "replaced (--straggler-policy replace)"
    elif policy is StragglerPolicy.REPLACE:
        outcome = "named only: no spare is free"
    else:
        outcome = "named only (--straggler-policy report)"
    why = f"{slower} {window} (at least {state.config.straggler_ratio:.2f}x)"
    ctx.emit(
        StragglerFound,
        node=view.node,
        ranks=[change.rank],
        cause="step_time",
        slowdown=change.slowdown,
        replaced=replace,
        reason=f"{why}: {outcome}",
    )
    if replace:
        recovery.fail(ctx, change.rank, ctx.record.ts, f"rank {change.rank} slows the job: {why}")


def _step_nonfinite(ctx: Context, record: StepNonFinite) -> None:
    """Counted, nothing to decide: the vote kept the step from every member and told each
    what to do (docs/hook.md, "Non-finite steps"). Believed only of the step the rank is in."""
    _in_step(ctx.state, record.rank, record.step)
    ctx.state.nonfinite[record.action] += 1


def _step_retried(ctx: Context, record: StepRetried) -> None:
    """Counted, nothing to decide: a vote closed with nobody failed behind it (no plan came)
    is voted on again by the members (docs/protocol.md, "A step"); a failure that did close
    it is acted on when its own record comes."""
    _in_step(ctx.state, record.rank, record.step)
    ctx.state.retried += 1


def _in_step(state: EngineState, rank: int, step: int) -> RankView:
    """The view of ``rank``, a member holding state whose step in progress is ``step``."""
    view = _member_holding_state(state, rank)
    if step != view.committed_step + 1:
        raise Rejected(
            f"rank {rank} has committed step {view.committed_step}: its step in progress is "
            f"{view.committed_step + 1}, not {step}"
        )
    return view


def _state_digest(ctx: Context, record: StateDigest) -> None:
    """A member's state as it began a step whose vote found replicas of a shard differing:
    once every member's is in, the replicas that differ from their shard's majority are
    replaced and restored from it; a shard with no majority can only fall back to the
    latest checkpoint, or the job fails naming its ranks and the step."""
    state = ctx.state
    _in_step(state, record.rank, record.step)
    shards = state.config.shards if state.config else 1
    if record.shard != record.rank % shards:
        raise Rejected(f"rank {record.rank} holds shard {record.rank % shards}, not {record.shard}")
    reports = state.digests.setdefault(record.step, {})
    reports[record.rank] = (record.shard, record.digest)
    if len(reports) < state.world_size:
        return
    del state.digests[record.step]
    outcome = integrity.compare(reports, record.step)
    if not outcome.odd:
        return
    gives_up = None
    if outcome.undecided and state.checkpoint is None:
        gives_up = f"{outcome.reason}; no complete checkpoint to fall back to"
    recovery.fail_ranks(ctx, outcome.odd, record.ts, outcome.reason, verdict=gives_up)


def _restore_rejected(ctx: Context, record: RestoreRejected) -> None:
    """A recipient's check of what it received failed: it loaded nothing and is replaced like a
    failed rank (its memory may be what is wrong); the donors that sent what differs give no
    state again while another replica of their shard holds it, else the next plan falls back."""
    state = ctx.state
    view = state.ranks[record.rank]
    if view.machine.state is not RankState.RESTORING or record.rank not in state.needs_state:
        raise Rejected(f"rank {record.rank} is {view.machine.state}, not a recipient restoring")
    if record.step != recovery.current_resume_step(state):
        raise Rejected(
            f"rank {record.rank} was to receive step {state.resume_step}, not {record.step}"
        )
    state.suspect_donors.update(record.donors)
    reason = f"rank {record.rank}'s restore failed its check: {record.error}"
    recovery.fail_ranks(ctx, [record.rank], record.ts, reason)


def _rank_exited(ctx: Context, record: RankExited) -> None:
    if record.source not in ("agent", f"agent:{record.node}"):  # "agent": older logs
        raise Rejected(f"an exit on node {record.node} told by {record.source!r}, not its agent")
    state = ctx.state
    if state.node_lost(record.node):
        # Its ranks and spares were given up with it; its agent, cut off and back, ends them
        # and says so: nothing to act on (replay's consistency check counts it as fenced).
        state.fenced += 1
        return
    holder = state.holders.get(record.pid)
    if holder is not None and state.ranks[holder].node != record.node:
        holder = None  # the same pid on another host
    if holder is None and record.rank is not None:
        never_joined = state.ranks[record.rank].machine.state == RankState.PENDING
        holder = record.rank if never_joined else None  # died before saying who it was
    how = f"signal {record.signal}" if record.signal is not None else f"code {record.exit_code}"
    how += f": {record.error}" if record.error else ""
    if holder is None:
        _spare_exited(ctx, record, how)
        return
    view = state.ranks[holder]
    if view.machine.state == RankState.FINISHED:
        return
    if view.machine.state == RankState.ISOLATED:  # its replacement died before taking over
        if record.spare_id in state.spares:
            state.spares[record.spare_id].status = SpareStatus.GONE
        recovery.replacement_died(ctx, holder, f"process {record.pid} exited ({how})", record.fatal)
        return
    recovery.fail(ctx, holder, record.ts, f"process {record.pid} exited ({how})", record.fatal)


def _spare_exited(ctx: Context, record: RankExited, how: str) -> None:
    """An idle spare that dies leaves the pool and is replaced; one that dies before it was
    ever ready is replaced only a bounded number of times (a script that can't start)."""
    state = ctx.state
    spare = state.spares.get(record.spare_id) if record.spare_id is not None else None
    if spare is not None and spare.pid == record.pid and spare.node == record.node:
        if spare.status == SpareStatus.READY:
            recovery.retire_spare(ctx, spare, f"exited ({how})")
        else:
            spare.status = SpareStatus.GONE
    elif record.spare_id is not None and record.spare_id not in state.spares:
        recovery.spare_lost_unready(
            ctx, record.spare_id, record.pid, how, record.node, record.fatal
        )
    else:
        state.fenced += 1  # a process that no longer holds any rank


def _collective_error(ctx: Context, record: CollectiveError) -> None:
    """A symptom, not a culprit: the reporting rank waits for the decision that the exit or
    a detector brings; nothing to decide from this record alone."""


def _heartbeat_missed(ctx: Context, record: HeartbeatMissed) -> None:
    reason = f"no heartbeat for {record.silent_s:.2f}s"
    recovery.fail(ctx, record.rank, record.last_seen_ts, reason)


def _stall_suspected(ctx: Context, record: StallSuspected) -> None:
    machine = ctx.state.ranks[record.rank].machine
    if machine.state == RankState.HEALTHY:
        ctx.fire(machine, Trigger.SUSPECT)
    elif machine.state == RankState.SUSPECT:
        reason = f"no progress past step {record.last_step} for {record.stalled_s:.2f}s"
        recovery.fail(ctx, record.rank, record.ts - record.stalled_s, reason)


def _health_report(ctx: Context, record: HealthReport) -> None:
    view = ctx.state.ranks[record.rank]
    if record.ok:
        recovery.clear_suspicion(ctx, view)
    else:
        recovery.fail(ctx, record.rank, record.ts, f"health check failed: {record.detail}")


def _spare_activated(ctx: Context, record: SpareActivated) -> None:
    spare = ctx.state.spares.get(record.spare_id)
    if spare is None:
        raise Rejected(f"spare {record.spare_id} never reported ready")
    spare.status = SpareStatus.ASSIGNED
    recovery.replacement_ready(ctx, record.rank, record.pid, warm=True)


def _replacement_spawned(ctx: Context, record: ReplacementSpawned) -> None:
    recovery.replacement_ready(ctx, record.rank, record.pid, warm=False)


def _rank_regrouped(ctx: Context, record: RankRegrouped) -> None:
    state = ctx.state
    view = state.ranks[record.rank]
    if state.job.state not in RECOVERING:
        raise Rejected(f"the job is {state.job.state}, not recovering")
    if view.machine.state == RankState.ISOLATED and view.pid in (None, record.pid):
        recovery.replacement_ready(ctx, record.rank, record.pid, warm=True)  # before the agent
    if view.machine.state == RankState.PENDING:  # generation 0 never formed: it joins in this one
        ctx.fire(view.machine, Trigger.JOIN)
        state.set_pid(record.rank, record.pid)
        view.host = ""
    if view.pid != record.pid:
        state.fenced += 1
        return
    if view.machine.state == RankState.JOINING:
        ctx.fire(view.machine, Trigger.PAUSE)
    if view.machine.state != RankState.PAUSED:
        raise Rejected(f"rank {record.rank} is {view.machine.state}, not regrouping")
    # Its last step record may have been fenced (sent as the generation ended), or lost: one
    # step past what the records say is possible, more is not. Steps its generation committed
    # after the plan (fenced, state.late_commit) count. A rank that loaded the latest
    # checkpoint in a fallback that a newer failure cut short holds that checkpoint's step.
    checkpoint = state.checkpoint[0] if state.checkpoint else -1
    held = max(state.max_committed(), state.late_commit, checkpoint)
    if record.committed_step > held + 1:
        raise Rejected(
            f"rank {record.rank} says it holds step {record.committed_step}, but no member "
            f"committed past {held}"
        )
    view.untried_spare = False  # it runs as the rank now: its failures are the rank's
    if record.rank not in state.regroups.reports:
        state.awaiting_regroup -= 1
    survivor = record.rank not in state.needs_state
    state.regroups.report(record.rank, record.committed_step, record.shard, survivor)
    view.shard = record.shard
    if state.resume_planned or state.awaiting_regroup > 0:
        return
    recovery.plan_resume(ctx)


def _state_restored(ctx: Context, record: StateTransferred | CheckpointLoaded) -> None:
    """A member holds the resume step's state: from its shard's donor, or from the checkpoint
    a fallback named."""
    state = ctx.state
    view = state.ranks[record.rank]
    ctx.require(view.machine, Trigger.END_RESTORE, f"rank {record.rank}")
    resume_step = recovery.current_resume_step(state)
    if isinstance(record, CheckpointLoaded) and record.step != resume_step:
        raise Rejected(f"rank {record.rank} loaded step {record.step}, the plan is {resume_step}")
    state.watch_from(record.rank, record.ts, view.grace_until_ts)
    state.needs_state.discard(record.rank)
    state.set_committed(record.rank, resume_step)
    recovery.maybe_restored(ctx)


def _checkpoint_saved(ctx: Context, record: CheckpointSaved) -> None:
    """A complete checkpoint, whatever generation wrote it: a committed step's state is the
    same in every timeline (a fallback recomputes the steps it rolls back)."""
    state = ctx.state
    if record.step > state.max_committed():
        raise Rejected(
            f"checkpoint of step {record.step}: no member committed past {state.max_committed()}"
        )
    if state.checkpoint is None or record.step >= state.checkpoint[0]:
        state.checkpoint = (record.step, record.path)


def _rank_finished(ctx: Context, record: RankFinished) -> None:
    ctx.require(ctx.state.ranks[record.rank].machine, Trigger.FINISH, f"rank {record.rank}")
    ctx.state.committed.set(record.rank, None)  # trains no more: no step waits for it
    recovery.maybe_close_incidents(ctx)  # a rank replaced after the last step resumes by finishing


def _job_finished(ctx: Context, record: JobFinished) -> None:
    job = ctx.state.job
    if record.status is JobOutcome.COMPLETED:
        ctx.require(job, Trigger.COMPLETE, "the job")
    elif job.state != JobState.FAILED:
        ctx.require(job, Trigger.FAIL, "the job")


HANDLERS: dict[type[Envelope], Callable[[Context, Any], None]] = {
    NodeJoined: _node_joined,
    NodeHeartbeat: _node_heartbeat,
    NodeMissed: _node_missed,
    AgentExited: _agent_exited,
    NodeWaitExpired: _node_wait_expired,
    RankJoined: _rank_joined,
    SpareReady: _spare_ready,
    SpareHeartbeat: _spare_heartbeat,
    SpareMissed: _spare_missed,
    Heartbeat: _heartbeat,
    StepCompleted: _step_completed,
    StepNonFinite: _step_nonfinite,
    StepRetried: _step_retried,
    StateDigest: _state_digest,
    RestoreRejected: _restore_rejected,
    RankExited: _rank_exited,
    CollectiveError: _collective_error,
    HeartbeatMissed: _heartbeat_missed,
    StallSuspected: _stall_suspected,
    HealthReport: _health_report,
    SpareActivated: _spare_activated,
    ReplacementSpawned: _replacement_spawned,
    RankRegrouped: _rank_regrouped,
    StateTransferred: _state_restored,
    CheckpointLoaded: _state_restored,
    CheckpointSaved: _checkpoint_saved,
    RankFinished: _rank_finished,
    JobFinished: _job_finished,
}
