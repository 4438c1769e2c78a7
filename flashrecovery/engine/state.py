"""What the engine knows about one job, built only from the job's records.

Nothing here reads a clock or the log: the decide step updates it record by record, so the same
records always rebuild the same state (replay, engine restart, failover). Aggregates over the
ranks (highest and lowest committed step, how many wait in commit(), who regrouped at which
step) are kept up to date as records arrive, so a heartbeat or a step costs the same whatever
the size of the world. What a recovery does to every member at once (pause them all for the new
generation, resume all but the recipients of state) is a sweep: recorded once, counted in the
aggregates at once, and applied to each rank the first time it is looked at afterwards, so a
recovery's decisions cost O(ranks affected), not O(world).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, deque
from collections.abc import Callable, ItemsView, Iterator, MutableMapping
from dataclasses import dataclass, field
from enum import StrEnum

from flashrecovery.engine.links import LinkBook
from flashrecovery.engine.stragglers import StepScores
from flashrecovery.errors import IllegalTransition
from flashrecovery.records import JobStarted
from flashrecovery.statemachines.base import Stamp, Trigger
from flashrecovery.statemachines.incident import OPEN, IncidentMachine
from flashrecovery.statemachines.job import JobMachine
from flashrecovery.statemachines.rank import ALIVE, RankMachine, RankState

STEP_WINDOW = 256  # recent step durations (any rank) whose median times the stall window
# Donors that share one shard's transfer at most: past a few, the recipient's own link bounds
# the restore, and each more donor only adds its messages' latency (docs/protocol.md).
MAX_STRIPES = 4
PAUSABLE = [s for s in ALIVE if s != RankState.PAUSED]  # the members a new generation pauses


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
    swept: int = 0  # how many of the job's sweeps this view has been brought through
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
    store: str | None = None  # the store its agent hosts (a multi-node job's)
    presence: str | None = None  # where its agent can be watched from (agent/presence.py)
    probe: str | None = None  # where its agent answers link probes (agent/link_probe.py)
    # The newest peer heartbeats whose probes of it came back, and did not: heard by a peer
    # after the log last heard it, its silence there is its writer held up, not the node gone.
    heard_by_peer_ts: float | None = None
    unheard_by_peer_ts: float | None = None

    def vouched_for(self) -> bool:
        """A peer heard it over their own link after its last heartbeat reached the log, and
        no peer's later probes failed."""
        heard = self.heard_by_peer_ts
        return (
            heard is not None
            and heard > self.last_heartbeat_ts
            and heard > (self.unheard_by_peer_ts or 0.0)
        )


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

    def rebase(self, step: int, count: int, keep: list[int]) -> None:
        """Every rank but ``keep`` now holds ``step`` (``count`` of them): counted at once; their
        entries in ``steps`` are written as each is next looked at (EngineState._settle)."""
        self.counts = Counter(self.steps[r] for r in keep if r in self.steps)
        if count:
            self.counts[step] += count

    def floor(self) -> int:
        return min(self.counts, default=-1)


@dataclass(frozen=True)
class Sweep:
    """A move of every member at once. ``resume_step`` None: a generation was planned and every
    member pauses; otherwise the resume plan: every member but ``recipients`` holds that step's
    state and resumes."""

    stamp: Stamp
    resume_step: int | None = None
    recipients: frozenset[int] = frozenset()


class RankTable(MutableMapping[int, RankView]):
    """The world's ranks by id. Looking a rank up first brings it through the sweeps made since
    it was last looked at, so every reader sees each rank as if the sweep had moved it at once."""

    def __init__(self, sweeps: list[Sweep], settle: Callable[[int, RankView], None]) -> None:
        self._views: dict[int, RankView] = {}
        self._sweeps, self._settle = sweeps, settle

    def __getitem__(self, rank: int) -> RankView:
        view = self._views[rank]
        if view.swept < len(self._sweeps):
            self._settle(rank, view)
        return view

    def __setitem__(self, rank: int, view: RankView) -> None:
        view.swept = len(self._sweeps)  # a new view owes nothing to the sweeps before it
        self._views[rank] = view

    def __delitem__(self, rank: int) -> None:
        del self._views[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, rank: object) -> bool:
        return rank in self._views

    def unsettled_items(self) -> ItemsView[int, RankView]:
        """Views as they are, sweeps not applied: only for what a sweep can only delay."""
        return self._views.items()


@dataclass
class RegroupTally:
    """Who reported regrouped in the current generation, kept as the reports arrive, so that the
    resume plan reads O(shards + recipients) instead of the world: every reporter's shard, the
    survivors (members that held state) by the step they hold, and at each step each shard's
    lowest MAX_STRIPES survivors (the donor candidates)."""

    reports: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # rank -> (step,
    # shard, survivor)
    shards: Counter[int] = field(default_factory=Counter)
    holders: dict[int, set[int]] = field(default_factory=dict)  # step -> survivors at it
    by_shard: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (step, shard) ->
    lowest: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # the same, lowest

    def report(self, rank: int, step: int, shard: int, survivor: bool) -> None:
        """A member's regroup report (a repeated one replaces the first)."""
        if rank in self.reports:
            self._withdraw(rank)
        self.reports[rank] = (step, shard, survivor)
        self.shards[shard] += 1
        if not survivor:
            return
        self.holders.setdefault(step, set()).add(rank)
        self.by_shard.setdefault((step, shard), set()).add(rank)
        lowest = self.lowest.setdefault((step, shard), [])
        if len(lowest) < MAX_STRIPES or rank < lowest[-1]:
            bisect.insort(lowest, rank)
            del lowest[MAX_STRIPES:]

    def _withdraw(self, rank: int) -> None:
        step, shard, survivor = self.reports.pop(rank)
        self.shards[shard] -= 1
        if not self.shards[shard]:
            del self.shards[shard]
        if not survivor:
            return
        self.holders[step].discard(rank)
        if not self.holders[step]:
            del self.holders[step]
        members = self.by_shard[(step, shard)]
        members.discard(rank)
        if rank in self.lowest[(step, shard)]:
            self.lowest[(step, shard)] = heapq.nsmallest(MAX_STRIPES, members)

    def top(self) -> int:
        """The highest step a survivor holds (-1: no survivor)."""
        return max(self.holders, default=-1)

    def behind(self, step: int) -> set[int]:
        """Survivors holding another step than ``step``."""
        return {r for held, ranks in self.holders.items() if held != step for r in ranks}


@dataclass
class EngineState:
    job_id: str
    config: JobStarted | None = None
    job: JobMachine = field(default_factory=lambda: JobMachine("job"))
    generation: int = 0
    sweeps: list[Sweep] = field(default_factory=list)
    ranks: RankTable = field(init=False)
    node_ranks: dict[int, set[int]] = field(default_factory=dict)  # node -> ranks it holds
    regroups: RegroupTally = field(default_factory=RegroupTally)  # the current generation's
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
    # The newest step a superseded generation's members said they committed after the plan
    # that superseded it (never applied): a member replaced alive (a straggler) leaves the
    # others training until the plan reaches them, so they may hold more than one step past it.
    late_commit: int = -1
    engine_faults: list[str] = field(default_factory=list)  # the engine's own bugs, said aloud
    verdict: str | None = None  # why the engine failed the job (FailJob), if it did
    failures: Counter[tuple[int, int]] = field(default_factory=Counter)  # (rank, step) -> count
    spares_lost_unready: int = 0  # spares that died before they were ready (a broken script)
    committed: StepIndex = field(default_factory=StepIndex)  # over the ranks that hold state
    rank_census: Counter[RankState] = field(default_factory=Counter)  # rank state -> ranks in it
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
    meeting: str | None = None  # the store the current generation meets on (multi-node)
    store_node: int | None = None  # the node whose agent hosts it (None: no node's)
    links: LinkBook = field(default_factory=LinkBook)  # the agents' probes of each other
    stragglers: set[int] = field(default_factory=set)  # nodes named, until their links heal
    nonfinite: Counter[str] = field(default_factory=Counter)  # action -> StepNonFinite records
    retried: int = 0  # StepRetried records: votes closed with no failure behind them
    # step -> rank -> (shard, digest): the members' states as a diverged vote left them
    digests: dict[int, dict[int, tuple[int, str]]] = field(default_factory=dict)
    # Ranks that sent a recipient state that differed from what their lead donor held
    # (RestoreRejected): no donors again while another replica of their shard can be.
    suspect_donors: set[int] = field(default_factory=set)
    # The ranks' compute times, scored against their peers' (engine/stragglers.py); sized
    # from JobStarted.
    step_scores: StepScores = field(default_factory=lambda: StepScores(window=20, ratio=2.0))

    def __post_init__(self) -> None:
        self.ranks = RankTable(self.sweeps, self._settle)

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
        self._watch(rank, self.ranks[rank], ts, grace_until)

    def _watch(self, rank: int, view: RankView, ts: float | None, grace: float | None) -> None:
        view.last_heartbeat_ts, view.grace_until_ts = ts, grace
        heapq.heappush(self.silence_due, (self._due(view), rank))
        if len(self.silence_due) > 4 * len(self.ranks) + 64:  # nobody pops (replay): compact
            # A view a sweep has not reached yet is due no later than it will be: when its
            # entry surfaces, looking at it applies the sweep, which pushes the later time.
            views = self.ranks.unsettled_items()
            self.silence_due = [(self._due(v), r) for r, v in views]
            heapq.heapify(self.silence_due)

    def silent_after(self, rank: int) -> float:
        """When the rank's silence becomes a missed heartbeat, by what the records say now."""
        return self._due(self.ranks[rank])

    def _due(self, view: RankView) -> float:
        assert self.config is not None
        config = self.config
        last = view.last_heartbeat_ts if view.last_heartbeat_ts is not None else config.ts
        return max(last + config.silence_limit_s, view.grace_until_ts or 0.0)

    def set_waiting(self, rank: int, waiting: bool) -> None:
        view = self.ranks[rank]
        self.waiting += int(waiting) - int(view.waiting)
        view.waiting = waiting

    def set_node(self, rank: int, node: int) -> None:
        """Whose agent holds the rank's process from now on."""
        view = self.ranks[rank]
        self.node_ranks.get(view.node, set()).discard(rank)
        view.node = node
        self.node_ranks.setdefault(node, set()).add(rank)

    def pause_members(self, stamp: Stamp) -> None:
        """A new generation is planned: every member pauses (a running one is timed for silence
        from now on), none waits in commit() and none has regrouped yet. O(1) here: the census
        and counts move now, each rank when it is next looked at."""
        census = self.rank_census
        paused = sum(census[s] for s in PAUSABLE)
        for s in PAUSABLE:
            census[s] = 0
        census[RankState.PAUSED] += paused
        self.waiting = 0
        self.awaiting_regroup = len(self.ranks)
        self.regroups = RegroupTally()
        self.sweeps.append(Sweep(stamp))

    def resume_members(self, stamp: Stamp, step: int, recipients: list[int]) -> None:
        """The resume plan: the recipients begin their restore now; every other member holds
        ``step`` and resumes (timed for silence from now on), applied to each when next
        looked at."""
        census = self.rank_census
        if census[RankState.PAUSED] != len(self.ranks):
            raise IllegalTransition(
                f"{len(self.ranks) - census[RankState.PAUSED]} member(s) not paused at the "
                f"resume plan (record {stamp.cause} at position {stamp.position})"
            )
        for rank in recipients:
            self.ranks[rank].machine.fire(Trigger.BEGIN_RESTORE, stamp)
        others = len(self.ranks) - len(recipients)
        census[RankState.PAUSED] -= others
        census[RankState.HEALTHY] += others
        self.committed.rebase(step, others, keep=recipients)
        self.sweeps.append(Sweep(stamp, step, frozenset(recipients)))

    def _settle(self, rank: int, view: RankView) -> None:
        """Bring a rank through the sweeps made since it was last looked at: the moves (with
        the sweep's stamp), the silence watch and the step each would have given it at once;
        the census and counts already hold them."""
        while view.swept < len(self.sweeps):
            sweep = self.sweeps[view.swept]
            view.swept += 1
            machine = view.machine
            if sweep.resume_step is None:
                view.waiting = False
                if machine.state in PAUSABLE:
                    machine.fire(Trigger.PAUSE, sweep.stamp, counted=False)
                    self._watch(rank, view, sweep.stamp.ts, view.grace_until_ts)
            elif rank not in sweep.recipients:
                machine.fire(Trigger.BEGIN_RESTORE, sweep.stamp, counted=False)
                machine.fire(Trigger.END_RESTORE, sweep.stamp, counted=False)
                self._watch(rank, view, sweep.stamp.ts, view.grace_until_ts)
                view.committed_step = self.committed.steps[rank] = sweep.resume_step
