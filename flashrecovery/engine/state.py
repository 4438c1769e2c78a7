"""What the engine knows about one job, built only from the job's records.

Nothing here reads a clock or the log: the decide step updates it record by record, so the same
records always rebuild the same state (replay, engine restart, failover). Aggregates over the
ranks (highest and lowest committed step, how many wait in commit()) are kept up to date as
records arrive, so a heartbeat or a step costs the same whatever the size of the world.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum

from flashrecovery.records import JobStarted
from flashrecovery.statemachines.base import Stamp
from flashrecovery.statemachines.incident import OPEN, IncidentMachine
from flashrecovery.statemachines.job import JobMachine
from flashrecovery.statemachines.rank import RankMachine

STEP_WINDOW = 256  # recent step durations (any rank) whose median times the stall window


@dataclass
class RankView:
    """A rank id and the process currently holding it. Its committed step and waiting flag are
    set through EngineState (set_committed, set_waiting), which keeps the aggregates."""

    machine: RankMachine
    node: int = 0  # whose agent holds its process
    pid: int | None = None
    host: str = ""
    shard: int = 0
    committed_step: int = -1  # highest step this rank reported committed (or was restored to)
    last_heartbeat_ts: float | None = None
    grace_until_ts: float | None = None  # a starting process is not missed before this, or
    # before its first sign of life (heartbeat, join)
    waiting: bool = False  # inside commit(), waiting on peers, as its last heartbeat said
    last_step_ts: float | None = None
    regrouped_step: int | None = None  # committed step reported for the current generation
    # The process is a hot spare that has not regrouped as this rank yet: if it fails, that is
    # the spare's fault (it was stopped or died idle), not the rank's, and no crash loop.
    untried_spare: bool = False


class SpareStatus(StrEnum):
    READY = "ready"  # warm, idle, waiting for an assignment
    ASSIGNED = "assigned"
    GONE = "gone"  # exited, or dropped from the pool


@dataclass
class SpareView:
    spare_id: int
    pid: int
    host: str
    status: SpareStatus = SpareStatus.READY
    last_heartbeat_ts: float | None = None
    node: int = 0


@dataclass
class NodeView:
    """A node's agent, from its NodeJoined on; ``lost`` once its silence isolated it."""

    node: int
    pid: int
    host: str
    last_heartbeat_ts: float
    lost: bool = False


@dataclass
class Incident:
    incident_id: str
    failed_rank: int
    failure_ts: float  # best estimate of when the fault happened
    generation: int  # the generation that recovers from it
    machine: IncidentMachine
    committed_before: int  # highest step any rank had reported committed before the fault
    detected: Stamp  # the record that revealed the fault
    reason: str
    resume_step: int | None = None
    failed_ranks: list[int] = field(default_factory=list)  # failed_rank and those lost with it
    failed_node: int | None = None  # a whole node was lost
    checkpoint_step: int | None = None  # restored from this checkpoint: no replica was left

    @property
    def what_failed(self) -> str:
        """ "rank 2", or "node 1 (ranks 2, 3)" for a lost node."""
        ranks = self.failed_ranks or [self.failed_rank]
        what = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return what if self.failed_node is None else f"node {self.failed_node} ({what})"


@dataclass
class StepIndex:
    """The committed step of every rank that holds training state (a failed rank leaves until
    it is restored), with the highest and lowest in O(distinct steps): the commit protocol keeps
    members within one step of each other, so that is two or three."""

    steps: dict[int, int] = field(default_factory=dict)
    counts: Counter[int] = field(default_factory=Counter)

    def set(self, rank: int, step: int | None) -> None:
        old = self.steps.pop(rank, None)
        if old is not None:
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        if step is not None:
            self.steps[rank] = step
            self.counts[step] += 1

    def top(self) -> int:
        return max(self.counts, default=-1)

    def floor(self) -> int:
        return min(self.counts, default=-1)


@dataclass
class EngineState:
    job_id: str
    config: JobStarted | None = None
    job: JobMachine = field(default_factory=lambda: JobMachine("job"))
    generation: int = 0
    ranks: dict[int, RankView] = field(default_factory=dict)
    spares: dict[int, SpareView] = field(default_factory=dict)
    nodes: dict[int, NodeView] = field(default_factory=dict)
    incidents: list[Incident] = field(default_factory=list)
    needs_state: set[int] = field(default_factory=set)  # replaced ranks not yet restored
    resume_planned: bool = False
    resume_step: int | None = None  # the current generation's, once planned
    position: int = -1  # last events position applied
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> count
    last_rejection: str = ""  # the newest reason, for the loop to report
    fenced: int = 0  # records of stale generations ignored
    engine_faults: list[str] = field(default_factory=list)  # the engine's own bugs, said aloud
    verdict: str | None = None  # why the engine failed the job (FailJob), if it did
    failures: Counter[tuple[int, int]] = field(default_factory=Counter)  # (rank, step) -> count
    spares_lost_unready: int = 0  # spares that died before they were ready (a broken script)
    committed: StepIndex = field(default_factory=StepIndex)  # over the ranks that hold state
    rank_census: Counter[str] = field(default_factory=Counter)  # rank state -> ranks in it
    awaiting_regroup: int = 0  # members of the current generation yet to report regrouped
    holders: dict[int, int] = field(default_factory=dict)  # pid -> the rank it holds now
    # (when the rank's silence becomes too long, rank), soonest first, one entry per change
    # (older entries are dropped as they surface): the silence detector looks only at the
    # entries already due, however large the world.
    silence_due: list[tuple[float, int]] = field(default_factory=list)
    last_step_ts: float | None = None  # the job's last step record: its progress
    step_durations: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    waiting: int = 0  # ranks whose last heartbeat said they wait inside commit()
    awaiting_node: dict[int, str] = field(default_factory=dict)  # rank -> incident, no spare yet
    awaiting_node_since: float | None = None  # when the first of them began to wait
    checkpoint: tuple[int, str] | None = None  # the latest complete checkpoint: (step, path)

    @property
    def world_size(self) -> int:
        return self.config.world_size if self.config else 0

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        self.last_rejection = reason

    def open_incidents(self) -> list[Incident]:
        return [i for i in self.incidents if i.machine.state in OPEN]

    def ready_spares(self) -> list[SpareView]:
        return sorted(
            (s for s in self.spares.values() if s.status == SpareStatus.READY),
            key=lambda s: s.spare_id,
        )

    def node_lost(self, node: int) -> bool:
        view = self.nodes.get(node)
        return view is not None and view.lost

    def max_committed(self) -> int:
        return self.committed.top()

    def set_committed(self, rank: int, step: int | None) -> None:
        """A rank's committed step; None: it holds no state now (failed, awaiting restore)."""
        self.ranks[rank].committed_step = -1 if step is None else step
        self.committed.set(rank, step)

    def set_pid(self, rank: int, pid: int | None) -> None:
        """The process that holds ``rank`` from now on (None: none yet, one is being started)."""
        view = self.ranks[rank]
        if view.pid is not None and self.holders.get(view.pid) == rank:
            del self.holders[view.pid]
        view.pid = pid
        if pid is not None:
            self.holders[pid] = rank

    def heard_from(self, rank: int, ts: float) -> None:
        """A sign of life from the rank's process: its silence counts from ``ts``, and a
        start-up grace is over."""
        self.watch_from(rank, ts, None)

    def watch_from(self, rank: int, ts: float | None, grace_until: float | None) -> None:
        """Time the rank's silence from ``ts`` (None: from the job's start), not before
        ``grace_until`` ends."""
        view = self.ranks[rank]
        view.last_heartbeat_ts, view.grace_until_ts = ts, grace_until
        heapq.heappush(self.silence_due, (self.silent_after(rank), rank))
        if len(self.silence_due) > 4 * len(self.ranks) + 64:  # nobody pops (replay): compact
            self.silence_due = [(self.silent_after(r), r) for r in self.ranks]
            heapq.heapify(self.silence_due)

    def silent_after(self, rank: int) -> float:
        """When the rank's silence becomes a missed heartbeat, by what the records say now."""
        assert self.config is not None
        view, config = self.ranks[rank], self.config
        last = view.last_heartbeat_ts if view.last_heartbeat_ts is not None else config.ts
        limit = config.silence_limit_s
        return max(last + limit, view.grace_until_ts or 0.0)

    def set_waiting(self, rank: int, waiting: bool) -> None:
        view = self.ranks[rank]
        self.waiting += int(waiting) - int(view.waiting)
        view.waiting = waiting
