"""Detectors that need time. They take ``now`` as an argument and return the findings as event
records; the loop appends them to the log first, so time enters the engine only as a record."""

from __future__ import annotations

import heapq
import statistics
from typing import Any

from flashrecovery.engine.state import EngineState, SpareStatus
from flashrecovery.records import (
    HeartbeatMissed,
    NodeMissed,
    NodeWaitExpired,
    SpareMissed,
    StallSuspected,
)
from flashrecovery.statemachines.job import ENDED, JobState
from flashrecovery.statemachines.rank import ALIVE, RankState

SLACK_S = 1e-6  # the heap's times are sums; the exact test below decides
WATCHED = (RankState.HEALTHY, RankState.SUSPECT)  # ranks expected to progress
BEATING = (RankState.PENDING, *ALIVE)  # processes expected to heartbeat (a recovery included)
NODE_QUIET = 1.5  # intervals of agent silence past which its ranks' silence is the node's


def _envelope(state: EngineState, now: float) -> dict[str, Any]:
    """A finding is stamped with the detector's clock: this is where time enters the log."""
    return {"job_id": state.job_id, "generation": state.generation, "source": "detector", "ts": now}


def silent_ranks(state: EngineState, now: float) -> list[HeartbeatMissed]:
    """Processes with no heartbeat for missed_heartbeats x interval, in any state in which they
    should beat (a hang during a recovery too), once a starting process's grace is over."""
    config = state.config
    if config is None or state.job.state in (*ENDED, JobState.FALLBACK):
        return []
    limit = config.silence_limit_s
    found, due = [], state.silence_due
    surfaced: list[tuple[float, int]] = []
    while due and due[0][0] <= now + SLACK_S:  # only what may be due: the rest is not
        entry = heapq.heappop(due)
        rank = entry[1]
        view = state.ranks[rank]
        if entry[0] != state.silent_after(rank) or view.machine.state not in BEATING:
            continue  # superseded by a newer entry, or not expected to beat: drop it
        surfaced.append(entry)
        last = view.last_heartbeat_ts if view.last_heartbeat_ts is not None else config.ts
        in_grace = view.grace_until_ts is not None and now <= view.grace_until_ts
        if in_grace or now - last <= limit:
            continue
        if _node_quiet(state, view.node, now):
            continue  # its agent is silent too: the node's loss is reported for all its ranks
        found.append(
            HeartbeatMissed(
                **_envelope(state, now),
                rank=rank,
                last_seen_ts=last,
                silent_s=round(now - last, 6),
            )
        )
    for entry in surfaced:  # still watched: a later call sees them again
        heapq.heappush(due, entry)
    return sorted(found, key=lambda finding: finding.rank)


def _node_quiet(state: EngineState, node: int, now: float) -> bool:
    """The node's agent missed a beat (or the node is lost): its processes' silence is the
    node's, reported once for all of them by ``silent_nodes``."""
    view = state.nodes.get(node)
    if view is None or state.config is None:
        return False
    return (
        view.lost or now - view.last_heartbeat_ts > NODE_QUIET * state.config.heartbeat_interval_s
    )


def silent_nodes(state: EngineState, now: float) -> list[NodeMissed]:
    """Agents with no heartbeat for missed_heartbeats x interval (the host gone, the agent
    SIGKILLed or SIGSTOPped): each loses its whole node at once; one its peers still hear over
    their own links gets the log's hold on top (its writer held up by a broker cut off, say).
    Once a rank has finished, the job is ending and agents leave as their ranks are done:
    silence is no loss then."""
    config = state.config
    if config is None or state.job.state in (*ENDED, JobState.FALLBACK):
        return []
    if state.rank_census[RankState.FINISHED]:
        return []
    limit = config.silence_limit_s
    return [
        NodeMissed(
            **_envelope(state, now),
            node=node.node,
            last_seen_ts=node.last_heartbeat_ts,
            silent_s=round(now - node.last_heartbeat_ts, 6),
        )
        for node in sorted(state.nodes.values(), key=lambda n: n.node)
        if not node.lost
        and now - node.last_heartbeat_ts > limit + (config.log_hold_s if node.vouched_for() else 0)
    ]


def node_wait_over(state: EngineState, now: float) -> list[NodeWaitExpired]:
    """Ranks of a lost node that waited longer than node_wait_s for a spare."""
    config, since = state.config, state.awaiting_node_since
    if config is None or since is None or now - since <= config.node_wait_s:
        return []
    if state.job.state in ENDED:
        return []
    return [
        NodeWaitExpired(
            **_envelope(state, now),
            ranks=sorted(state.awaiting_node),
            waited_s=round(now - since, 6),
        )
    ]


def stalled_ranks(state: EngineState, now: float) -> list[StallSuspected]:
    """While the job makes no step progress for max(k x median step, floor), suspect the ranks
    that hold the others up: those outside commit() while a peer waits inside it, and those
    behind their peers; not those of a node gone quiet (its records held up with its beats,
    or the node gone: silent_nodes judges it). One finding per window: a rank still stalled a
    window later fails."""
    config = state.config
    if config is None or state.job.state != JobState.RUNNING:
        return []
    durations = state.step_durations
    window = max(
        config.stall_factor * statistics.median(durations) if durations else 0.0,
        config.stall_floor_s,
    )
    running = state.job.entered(JobState.RUNNING)
    last_progress = max(state.last_step_ts or 0.0, running.ts if running else 0.0)
    if not last_progress or now - last_progress <= window:
        return []
    watched = {r: v for r, v in state.ranks.items() if v.machine.state in WATCHED}
    top = state.max_committed()
    peers_wait = any(v.waiting for v in watched.values())
    return [
        StallSuspected(
            **_envelope(state, now),
            rank=rank,
            last_step=view.committed_step,
            stalled_s=round(now - (view.last_step_ts or last_progress), 6),
            window_s=round(window, 6),
        )
        for rank, view in sorted(watched.items())
        if (view.committed_step < top or (peers_wait and not view.waiting))
        and not _node_quiet(state, view.node, now)  # its node's silence is judged for it
    ]


def silent_spares(state: EngineState, now: float) -> list[SpareMissed]:
    """Idle spares with no heartbeat for missed_heartbeats x interval (SIGSTOPped, hung): they
    must leave the pool before a failure picks them."""
    config = state.config
    if config is None or state.job.state in ENDED:
        return []
    limit = config.silence_limit_s
    return [
        SpareMissed(
            **_envelope(state, now),
            spare_id=spare.spare_id,
            last_seen_ts=spare.last_heartbeat_ts,
            silent_s=round(now - spare.last_heartbeat_ts, 6),
        )
        for spare in sorted(state.spares.values(), key=lambda s: s.spare_id)
        if spare.status == SpareStatus.READY
        and spare.last_heartbeat_ts is not None
        and now - spare.last_heartbeat_ts > limit
        and not _node_quiet(state, spare.node, now)
    ]


Finding = HeartbeatMissed | StallSuspected | SpareMissed | NodeMissed | NodeWaitExpired
FindingKey = tuple[str, int, int, int | None, int]


def finding_key(state: EngineState, record: Finding) -> FindingKey:
    """A finding is reported once per process it is about (and a stall once per window it
    lasts: suspect, then failed)."""
    if isinstance(record, NodeMissed):
        return (record.type, record.generation, record.node, state.nodes[record.node].pid, 0)
    if isinstance(record, NodeWaitExpired):
        return (record.type, record.generation, min(record.ranks), None, 0)
    if isinstance(record, SpareMissed):
        spare = state.spares[record.spare_id]
        return (record.type, record.generation, spare.spare_id, spare.pid, 0)
    windows = int(record.stalled_s // record.window_s) if isinstance(record, StallSuspected) else 0
    view = state.ranks[record.rank]
    return (record.type, record.generation, record.rank, view.pid, windows)


def fresh_findings(
    state: EngineState,
    now: float,
    reported: set[FindingKey],
    *,
    silence: bool = True,
    stalls: bool = True,
) -> list[Finding]:
    """What the detectors find at ``now`` that was not reported yet (``silence``: missed
    heartbeats of nodes, ranks and spares, and a lost node's wait for capacity running out;
    ``stalls``: stalled ranks). A silent node comes first: its ranks go with it."""
    found: list[Finding] = [
        *(silent_nodes(state, now) if silence else []),
        *(node_wait_over(state, now) if silence else []),
        *(silent_ranks(state, now) if silence else []),
        *(stalled_ranks(state, now) if stalls else []),
        *(silent_spares(state, now) if silence else []),
    ]
    return [record for record in found if finding_key(state, record) not in reported]
