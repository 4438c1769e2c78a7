"""Follow a running job through its log, and kill ranks from outside when they reach a step.

The watch rebuilds what the engine knows with the engine's own pure decide step (the same thing
replay does), so pids, committed steps, generation, spares and incidents come from one source of
truth: the log. The killer sends a real SIGKILL to the pid the log names for a rank, which is
how a machine or process failure looks to everyone else.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from flashrecovery.connectors.base import LogConnector
from flashrecovery.connectors.follow import StreamCursor
from flashrecovery.demo.job import LaunchedJob
from flashrecovery.engine.ingest import ingest
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.engine.state import EngineState
from flashrecovery.records import JobFinished, RankJoined, Stream
from flashrecovery.statemachines.incident import IncidentState
from flashrecovery.statemachines.job import JobState

POLL_S = 0.05  # longest wait for new records before the killer looks again


class JobWatch:
    """What the log says about one job so far; ``poll`` reads what is new."""

    def __init__(self, log: LogConnector, job_id: str) -> None:
        self.log = log
        self.job_id = job_id
        self.state = EngineState(job_id)
        self.joined_pids: dict[int, int] = {}  # the generation-0 process of each rank
        self.finished: JobFinished | None = None
        self.leases = LeaseBook()  # which engine decides, with --external-engine
        self.last_record = ""
        self._events = StreamCursor(log, Stream.EVENTS, job_id)

    def poll(self, timeout: float) -> int:
        """Apply the events that arrive within ``timeout``; returns how many."""
        entries = self._events.poll(timeout)
        for entry in entries:
            ingest(self.state, entry)
            record = entry.record
            self.leases.fold(record)
            if isinstance(record, RankJoined):
                self.joined_pids[record.rank] = record.pid
            elif isinstance(record, JobFinished):
                self.finished = record
            if record is not None and record.type not in ("heartbeat", "step_completed"):
                self.last_record = f"{record.type} from {record.source}"
        return len(entries)

    def committed(self, rank: int | None = None) -> int:
        """The highest step a rank (default: every rank) has committed; -1 before any."""
        ranks = self.state.ranks
        if rank is not None:
            return ranks[rank].committed_step if rank in ranks else -1
        return min((v.committed_step for v in ranks.values()), default=-1)

    def pid_of(self, rank: int) -> int | None:
        view = self.state.ranks.get(rank)
        return None if view is None else view.pid

    def agent_pid(self, node: int) -> int | None:
        view = self.state.nodes.get(node)
        return None if view is None else view.pid

    @property
    def running(self) -> bool:
        """Training in the current generation, with no recovery under way."""
        return self.state.job.state is JobState.RUNNING

    @property
    def ready_spares(self) -> int:
        return len(self.state.ready_spares())

    @property
    def incidents(self) -> tuple[int, int]:
        """(opened, closed) incidents."""
        closed = sum(i.machine.state is IncidentState.CLOSED for i in self.state.incidents)
        return len(self.state.incidents), closed


class KillOutcome(StrEnum):
    PENDING = "pending"
    KILLED = "killed"
    MISSED = "missed"  # the target had finished or was gone already


@dataclass
class Kill:
    """Kill ``rank`` once it works on ``step`` (it has committed step - 1); ``sig`` may be
    another signal (SIGSTOP: a hung process). With ``node``, the whole node (its agent's
    process group, SIGKILL) once every rank works on ``step``."""

    rank: int | None
    step: int
    sig: signal.Signals = signal.SIGKILL
    node: int | None = None
    pid: int | None = None  # the rank's process, or the node's agent
    committed: int | None = None  # the rank's committed step when the signal went out
    ts: float | None = None  # unix time of the SIGKILL
    outcome: KillOutcome = KillOutcome.PENDING
    # Once the target has committed this step the kill goes out without waiting for a ready
    # spare (a chaos run's next fault must not meet it late).
    spare_wait_until: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Kill:
        rank, sep, step = spec.partition("@")
        if not sep or not rank.isdigit() or not step.isdigit():
            raise ValueError(f"--kill {spec!r}: expected RANK@STEP, e.g. 1@3")
        return cls(int(rank), int(step))

    @classmethod
    def parse_node(cls, spec: str) -> Kill:
        node, sep, step = spec.partition("@")
        if not sep or not node.isdigit() or not step.isdigit():
            raise ValueError(f"--kill-node {spec!r}: expected NODE@STEP, e.g. 1@3")
        return cls(None, int(step), node=int(node))

    @property
    def target(self) -> str:
        return f"rank {self.rank}" if self.node is None else f"node {self.node}"

    def describe(self) -> str:
        if self.outcome is KillOutcome.PENDING:
            return f"{self.target} at step {self.step} (pending)"
        if self.outcome is KillOutcome.MISSED:
            return f"{self.target} at step {self.step}: missed (finished or already gone)"
        working_on = self.step if self.committed is None else self.committed + 1
        process = "pid" if self.node is None else "agent pid"
        return f"{self.target} ({process} {self.pid}) during step {working_on}"


@dataclass
class Killer:
    """Carries out kills in order, one at a time, each once the job is running again.

    With spares in the job it waits (up to ``spare_wait_s``, and until the kill's
    ``spare_wait_until`` step) for a hot spare to be ready, so a kill shows the hot-spare path
    rather than racing the spare's start-up.
    """

    job: LaunchedJob
    plan: list[Kill] = field(default_factory=list)
    spare_wait_s: float = 15.0
    due_since: float | None = field(default=None, init=False)  # when the next kill fell due

    @property
    def pending(self) -> list[Kill]:
        return [k for k in self.plan if k.outcome is KillOutcome.PENDING]

    def tick(self, watch: JobWatch) -> Kill | None:
        """Fire the next kill if it is due now; returns it when it fired (or missed)."""
        if not self.pending or not watch.running:
            return None
        kill = self.pending[0]
        committed = watch.committed(kill.rank)  # a node kill: every rank's
        if committed < kill.step - 1:
            return None
        if committed >= self.job.spec.steps - 1:  # done training: a kill would test shutdown
            kill.outcome = KillOutcome.MISSED
            return kill
        now = time.monotonic()
        self.due_since = self.due_since or now
        spec = self.job.spec
        needed = 1 if kill.node is None else spec.nproc // spec.nodes  # a node's ranks
        pooled = spec.spares > 0 or spec.spare_nodes > 0
        spare_due = (
            pooled
            and now - self.due_since < self.spare_wait_s
            and (kill.spare_wait_until is None or committed < kill.spare_wait_until)
        )
        if spare_due and watch.ready_spares < needed:
            return None
        self.due_since = None
        kill.committed = committed
        if kill.node is not None:
            kill.pid = watch.agent_pid(kill.node)
            kill.ts = self.job.kill_node(kill.node)
        else:
            kill.pid = watch.pid_of(kill.rank) if kill.rank is not None else None
            kill.ts = None if kill.pid is None else self.job.kill_descendant(kill.pid, kill.sig)
        kill.outcome = KillOutcome.MISSED if kill.ts is None else KillOutcome.KILLED
        return kill


def follow(
    job: LaunchedJob,
    watch: JobWatch,
    killer: Killer,
    timeout: float,
    on_tick: Callable[[Kill | None], None],
    until: Callable[[], bool] = lambda: False,
) -> int | None:
    """Watch the job and carry out its kills until the agent exits, ``until()`` holds or the
    timeout passes; ``on_tick`` sees each round (and the kill fired in it). Returns the agent's
    exit code, None while it still runs."""
    deadline = time.monotonic() + timeout
    while job.poll() is None and not until() and time.monotonic() < deadline:
        watch.poll(POLL_S)
        on_tick(killer.tick(watch))
    while job.poll() is not None and watch.poll(POLL_S):
        pass  # the records written just before the agent exited (a running job never pauses)
    on_tick(None)
    return job.poll()
