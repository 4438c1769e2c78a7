"""Recovery choices, as pure functions of the engine state: which spare, which donor, which step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from flashrecovery.engine.state import EngineState

FRESH_SPARE_INTERVALS = 2.0  # a spare not heard from for this many heartbeats is not handed a rank
# Donors that share one shard's transfer at most: past a few, the recipient's own link bounds
# the restore, and each more donor only adds its messages' latency (docs/protocol.md).
MAX_STRIPES = 4


def choose_spares(state: EngineState, count: int, now: float) -> list[int]:
    """Up to ``count`` ready spares, from the node with the most of them first (the ranks of a
    lost node then land together), the lowest ids there (oldest, so warmed up longest). A spare
    whose last heartbeat is older than FRESH_SPARE_INTERVALS at ``now`` (the deciding record's
    time) is passed over: it may be stopped, and its silence is not yet long enough to retire
    it; a fresh process is the safer replacement."""
    assert state.config is not None
    stale_after = FRESH_SPARE_INTERVALS * state.config.heartbeat_interval_s
    ready = [
        s
        for s in state.ready_spares()
        if s.last_heartbeat_ts is None or now - s.last_heartbeat_ts <= stale_after
    ]
    per_node = Counter(s.node for s in ready)
    ready.sort(key=lambda s: (-per_node[s.node], s.node, s.spare_id))
    return [s.spare_id for s in ready[:count]]


@dataclass(frozen=True)
class ResumePlan:
    resume_step: int
    donors: dict[int, int]  # shard -> donor rank (the lead of its stripes)
    recipients: list[int]
    stripes: dict[int, list[int]]  # shard -> the donors sharing its transfer (when several)


@dataclass(frozen=True)
class NoReplica:
    """Some shard has no member holding its state: only a checkpoint can restore it."""

    shards: list[int]


def plan_resume(state: EngineState) -> ResumePlan | NoReplica:
    """Resume after the highest step the survivors committed; each shard's donors are its
    lowest survivors at that step (up to MAX_STRIPES, each sends a stripe, the lowest leads);
    replaced ranks and any member behind receive state."""
    survivors = {
        rank: view
        for rank, view in state.ranks.items()
        if rank not in state.needs_state and view.regrouped_step is not None
    }
    shards = sorted({view.shard for view in state.ranks.values()})
    resume_step = max(
        (v.regrouped_step for v in survivors.values() if v.regrouped_step is not None), default=-1
    )
    stripes: dict[int, list[int]] = {}
    for shard in shards:
        holders = sorted(
            r for r, v in survivors.items() if v.shard == shard and v.regrouped_step == resume_step
        )
        if holders:
            stripes[shard] = holders[:MAX_STRIPES]
    missing = [s for s in shards if s not in stripes]
    if missing or not survivors:
        return NoReplica(missing or shards)
    recipients = sorted(
        rank
        for rank, view in state.ranks.items()
        if rank in state.needs_state or view.regrouped_step != resume_step
    )
    donors = {shard: ranks[0] for shard, ranks in stripes.items()}
    striped = {shard: ranks for shard, ranks in stripes.items() if len(ranks) > 1}
    return ResumePlan(resume_step, donors, recipients, striped)
