"""Recovery choices, as pure functions of the engine state: which spare, which donor, which step."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from flashrecovery.engine.state import MAX_STRIPES, EngineState, SpareView

FRESH_SPARE_INTERVALS = 2.0  # a spare not heard from for this many heartbeats is not handed a rank


def choose_spares(state: EngineState, ranks: list[int], now: float) -> list[int]:
    """Up to one ready spare per rank of ``ranks``: first from the nodes holding the fewest of
    the job's other ranks (a spare node before a training one: one node's later loss then takes
    as few replicas as it can), then from the node with the most ready spares (the ranks of a
    lost node land together), the lowest ids there (oldest, so warmed up longest). A spare
    whose last heartbeat is older than FRESH_SPARE_INTERVALS at ``now`` (the deciding record's
    time) is passed over: it may be stopped, and its silence is not yet long enough to retire
    it; a fresh process is the safer replacement."""
    ready = fresh_spares(state, now)
    per_node = Counter(s.node for s in ready)
    placed = set(ranks)
    held = {node: len(state.node_ranks.get(node, set()) - placed) for node in per_node}
    ready.sort(key=lambda s: (held[s.node], -per_node[s.node], s.node, s.spare_id))
    return [s.spare_id for s in ready[: len(ranks)]]


def fresh_spares(state: EngineState, now: float) -> list[SpareView]:
    """The ready spares heard from within FRESH_SPARE_INTERVALS at ``now``."""
    assert state.config is not None
    stale_after = FRESH_SPARE_INTERVALS * state.config.heartbeat_interval_s
    return [
        s
        for s in state.ready_spares()
        if s.last_heartbeat_ts is None or now - s.last_heartbeat_ts <= stale_after
    ]


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
    lowest survivors at that step (up to state.MAX_STRIPES, each sends a stripe, the lowest leads)
    that never sent a restore what it failed its check on (a shard with none left has no replica);
    replaced ranks and any member behind receive state. Read from the regroup reports' tally:
    O(shards + recipients), whatever the size of the world."""
    tally = state.regroups
    shards = sorted(tally.shards)
    resume_step = tally.top()
    stripes = {
        shard: list(tally.lowest[(resume_step, shard)])
        for shard in shards
        if tally.lowest.get((resume_step, shard))
    }
    if state.suspect_donors:  # rare: a restore failed its check (engine/decide.py)
        stripes = {shard: _trusted(state, resume_step, shard) for shard in stripes}
        stripes = {shard: ranks for shard, ranks in stripes.items() if ranks}
    missing = [s for s in shards if s not in stripes]
    if missing or not tally.holders:
        return NoReplica(missing or shards)
    recipients = sorted(state.needs_state | tally.behind(resume_step))
    donors = {shard: ranks[0] for shard, ranks in stripes.items()}
    striped = {shard: ranks for shard, ranks in stripes.items() if len(ranks) > 1}
    return ResumePlan(resume_step, donors, recipients, striped)


def _trusted(state: EngineState, step: int, shard: int) -> list[int]:
    """The shard's lowest survivors at ``step`` that are not suspect donors: O(its replicas)."""
    members = state.regroups.by_shard[(step, shard)] - state.suspect_donors
    return heapq.nsmallest(MAX_STRIPES, members)
