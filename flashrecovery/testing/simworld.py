"""A scripted world without torch: plays the agent and the ranks as records on a scripted clock.

It answers each decision the way the real agent and trainer hooks do (docs/protocol.md), which
lets tests, the example log writer and the decide benchmark exercise the whole recovery path
deterministically and fast.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flashrecovery.connectors.base import LogConnector
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.records import (
    AssignSpare,
    CheckpointLoaded,
    CheckpointSaved,
    Decision,
    Envelope,
    FallbackToCheckpoint,
    Heartbeat,
    JobFinished,
    JobOutcome,
    JobStarted,
    NodeHeartbeat,
    NodeJoined,
    RankExited,
    RankFinished,
    RankJoined,
    RankRegrouped,
    RegroupPlanned,
    ReplacementSpawned,
    RestoreRejected,
    ResumePlanned,
    RetireSpare,
    SpareActivated,
    SpareHeartbeat,
    SpareReady,
    SpawnReplacement,
    StateTransferred,
    StepCompleted,
    StragglerPolicy,
    Stream,
)

HOST = "sim-host"


@dataclass
class SimulatedWorld:
    job_id: str
    world_size: int = 4
    spares: int = 1
    heartbeat_interval_s: float = 0.5
    step_s: float = 0.2
    shards: int = 1  # rank r holds shard r % shards
    clock: float = 1_800_000_000.0
    generation: int = 0
    committed: int = -1
    pids: dict[int, int] = field(default_factory=dict)
    spare_pids: dict[int, int] = field(default_factory=dict)
    answered: int = 0  # decisions reacted to so far
    garbled_restores: int = 0  # this many resume plans' recipients find their state garbled
    # rank -> how many times its peers' compute time its steps take (engine/stragglers.py)
    slowdown: dict[int, float] = field(default_factory=dict)
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT
    straggler_steps: int = 20
    _next_pid: int = 1000
    _next_spare: int = 0

    def _pid(self) -> int:
        self._next_pid += 1
        return self._next_pid

    def _at(self, dt: float = 0.001) -> float:
        self.clock = round(self.clock + dt, 6)
        return self.clock

    def _env(self, source: str) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "generation": self.generation,
            "source": source,
            "ts": self._at(),
        }

    def start(self) -> list[Envelope]:
        out: list[Envelope] = [
            JobStarted(
                **self._env("agent"),
                world_size=self.world_size,
                spares=self.spares,
                heartbeat_interval_s=self.heartbeat_interval_s,
                shards=self.shards,
                straggler_policy=self.straggler_policy,
                straggler_steps=self.straggler_steps,
            )
        ]
        for _ in range(self.spares):
            out.append(self.add_spare())
        for rank in range(self.world_size):
            self.pids[rank] = self._pid()
            out.append(
                RankJoined(
                    **self._env(f"rank:{rank}"),
                    rank=rank,
                    pid=self.pids[rank],
                    host=HOST,
                    shard=rank % self.shards,
                )
            )
        return out

    def add_spare(self) -> SpareReady:
        spare_id, self._next_spare = self._next_spare, self._next_spare + 1
        self.spare_pids[spare_id] = self._pid()
        return SpareReady(
            **self._env("agent"), spare_id=spare_id, pid=self.spare_pids[spare_id], host=HOST
        )

    def train(self, steps: int) -> Iterator[Envelope]:
        for _ in range(steps):
            step = self.committed + 1
            self._at(self.step_s)
            for rank, pid in sorted(self.pids.items()):
                yield Heartbeat(
                    **self._env(f"rank:{rank}"), rank=rank, step=step, pid=pid, host=HOST
                )
            yield from self.spare_heartbeats()
            for rank in sorted(self.pids):
                yield StepCompleted(
                    **self._env(f"rank:{rank}"),
                    rank=rank,
                    step=step,
                    duration_s=self.step_s,
                    compute_s=round(self.step_s / 2 * self.slowdown.get(rank, 1.0), 6),
                    loss=round(1.0 / (step + 1), 6),
                )
            self.committed = step

    def spare_heartbeats(self, ts: float | None = None) -> list[SpareHeartbeat]:
        """The idle spares' heartbeats, now or at ``ts``."""
        env = {**self._env("spare"), **({} if ts is None else {"ts": ts})}
        return [
            SpareHeartbeat(**env, spare_id=spare_id, pid=pid)
            for spare_id, pid in sorted(self.spare_pids.items())
        ]

    def checkpoint(self) -> CheckpointSaved:
        """Rank 0 says the checkpoint of the committed step is complete."""
        step = self.committed
        return CheckpointSaved(**self._env("rank:0"), step=step, path=f"/ckpt/step-{step}")

    def kill(self, rank: int, signal: int = 9) -> RankExited:
        return RankExited(**self._env("agent"), rank=rank, pid=self.pids[rank], signal=signal)

    def raise_in(self, rank: int) -> RankExited:
        return RankExited(**self._env("agent"), rank=rank, pid=self.pids[rank], exit_code=1)

    def finish(self) -> list[Envelope]:
        out: list[Envelope] = [
            RankFinished(**self._env(f"rank:{r}"), rank=r, step=self.committed)
            for r in sorted(self.pids)
        ]
        out.append(JobFinished(**self._env("agent"), status=JobOutcome.COMPLETED))
        return out

    def react(self, decision: Decision) -> list[Envelope]:
        """What the agent and the hooks append in answer to a decision."""
        self.answered += 1
        if isinstance(decision, AssignSpare):
            pid = self.spare_pids.pop(decision.spare_id)
            self.pids[decision.rank] = pid
            return [
                SpareActivated(
                    **self._env("agent"), spare_id=decision.spare_id, rank=decision.rank, pid=pid
                )
            ]
        if isinstance(decision, RetireSpare):
            self.spare_pids.pop(decision.spare_id, None)
            return [self.add_spare()] if decision.refill else []
        if isinstance(decision, SpawnReplacement):
            self.pids[decision.rank] = self._pid()
            return [
                ReplacementSpawned(
                    **self._env("agent"), rank=decision.rank, pid=self.pids[decision.rank]
                )
            ]
        if isinstance(decision, RegroupPlanned):
            self.generation = decision.generation
            return [
                RankRegrouped(
                    **self._env(f"rank:{rank}"),
                    rank=rank,
                    committed_step=-1 if rank in decision.replaced else self.committed,
                    pid=self.pids[rank],
                    shard=rank % self.shards,
                )
                for rank in decision.members
            ]
        if isinstance(decision, ResumePlanned) and self.garbled_restores:
            self.garbled_restores -= 1
            return [
                RestoreRejected(
                    **self._env(f"rank:{rank}"),
                    rank=rank,
                    step=decision.resume_step,
                    donors=[decision.donors[rank % self.shards]],
                    tensors=1,
                    error="1 of the 8 tensors received differ from what the donors sent",
                )
                for rank in decision.recipients
            ]
        if isinstance(decision, ResumePlanned):
            self.committed = decision.resume_step
            return [
                StateTransferred(
                    **self._env(f"rank:{rank}"),
                    rank=rank,
                    donor=decision.donors[0],
                    bytes=4096,
                    ms=3.0,
                )
                for rank in decision.recipients
            ]
        if isinstance(decision, FallbackToCheckpoint) and decision.step is not None:
            self.committed = decision.step
            return [
                CheckpointLoaded(**self._env(f"rank:{rank}"), rank=rank, step=decision.step, ms=5.0)
                for rank in sorted(self.pids)
            ]
        return []


@dataclass
class SimulatedNodes:
    """A large job as the engine sees it when agents carry the beats (docs/multinode.md): nodes
    of ``per_node`` ranks, one agent each, plus one spare node of ``per_node`` hot spares; each
    agent writes one NodeHeartbeat per interval carrying its processes' heartbeats."""

    job_id: str
    nodes: int
    per_node: int = 8
    heartbeat_interval_s: float = 1.0
    clock: float = 1_800_000_000.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def spare_node(self) -> int:
        return self.nodes

    def _env(self, source: str) -> dict[str, Any]:
        return {"job_id": self.job_id, "generation": 0, "source": source, "ts": self.clock}

    def start(self) -> list[Envelope]:
        """The job's start: configuration, every node, rank and spare joined."""
        out: list[Envelope] = [
            JobStarted(
                **self._env("agent"),
                world_size=self.world_size,
                spares=self.per_node,
                heartbeat_interval_s=self.heartbeat_interval_s,
                nodes=self.nodes,
            )
        ]
        for node in range(self.nodes + 1):
            training = node != self.spare_node
            out.append(
                NodeJoined(
                    **self._env(f"agent:{node}"),
                    node=node,
                    pid=self._agent_pid(node),
                    host=f"{HOST}-{node}",
                    ranks=self.per_node if training else 0,
                    spares=0 if training else self.per_node,
                )
            )
        out += [
            RankJoined(**self._env(f"rank:{r}"), rank=r, pid=self._rank_pid(r), host=HOST)
            for r in range(self.world_size)
        ]
        out += [
            SpareReady(
                **self._env("agent"), spare_id=s, pid=self._spare_pid(s), host=HOST, node=self.nodes
            )
            for s in range(self.per_node)
        ]
        return out

    def beat(self, node: int) -> NodeHeartbeat:
        """Node ``node``'s agent's heartbeat now, with its ranks' (or spares') beats."""
        env = self._env(f"agent:{node}")
        beats: list[Heartbeat | SpareHeartbeat]
        if node == self.spare_node:
            beats = [
                SpareHeartbeat(**env, spare_id=s, pid=self._spare_pid(s))
                for s in range(self.per_node)
            ]
        else:
            first = node * self.per_node
            beats = [
                Heartbeat(**env, rank=r, step=-1, pid=self._rank_pid(r), host=HOST)
                for r in range(first, first + self.per_node)
            ]
        return NodeHeartbeat(**env, node=node, pid=self._agent_pid(node), beats=beats)

    def _agent_pid(self, node: int) -> int:
        return 1 + node

    def _rank_pid(self, rank: int) -> int:
        return 1_000_000 + rank

    def _spare_pid(self, spare_id: int) -> int:
        return 2_000_000 + spare_id


def drive(
    log: LogConnector, engine: EngineLoop, world: SimulatedWorld, records: Iterable[Envelope]
) -> list[Decision]:
    """Append records, let the engine decide, answer its decisions, until all is quiet.
    Returns the decisions written during the call."""
    pending = list(records)
    seen = len(log.read(Stream.DECISIONS, world.job_id))
    written: list[Decision] = []
    while pending:
        for record in pending:
            log.append(Stream.EVENTS, record)
        pending = []
        engine.apply(log.read(Stream.EVENTS, world.job_id, engine.next_position))
        new = [e.record for e in log.read(Stream.DECISIONS, world.job_id)[seen:]]
        seen += len(new)
        for decision in new:
            assert isinstance(decision, Decision)
            written.append(decision)
            pending.extend(world.react(decision))
    return written


def scripted_failure(
    log: LogConnector,
    job_id: str,
    *,
    world_size: int = 4,
    spares: int = 1,
    kill_rank: int = 2,
    steps_before: int = 3,
    steps_after: int = 2,
) -> list[Decision]:
    """The reference scenario: train, SIGKILL one rank, recover, train on, finish.
    Returns every decision the engine wrote."""
    world = SimulatedWorld(job_id, world_size=world_size, spares=spares)
    engine = EngineLoop(log, job_id)
    decisions = drive(log, engine, world, world.start())
    decisions += drive(log, engine, world, world.train(steps_before))
    decisions += drive(log, engine, world, [world.kill(kill_rank)])
    decisions += drive(log, engine, world, world.train(steps_after))
    decisions += drive(log, engine, world, world.finish())
    return decisions


def scripted_hang(
    log: LogConnector,
    job_id: str,
    *,
    hung: int = 1,
    heartbeat_interval_s: float = 0.5,
    poll_s: float = 0.05,
) -> None:
    """Train, then rank ``hung`` stops (SIGSTOP): its peers wait in commit() and keep beating
    every interval until the engine's detector, looking every ``poll_s``, misses it; the spare
    takes over and the job finishes."""
    world = SimulatedWorld(
        job_id, world_size=3, spares=1, heartbeat_interval_s=heartbeat_interval_s
    )
    engine = EngineLoop(log, job_id, clock=lambda: world.clock)
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(4))
    stopped_pid = world.pids[hung]
    next_beat = world.clock + heartbeat_interval_s
    while not engine.detect():
        world.clock = round(world.clock + poll_s, 6)
        if world.clock >= next_beat:
            next_beat += heartbeat_interval_s
            beats = [
                Heartbeat(
                    **world._env(f"rank:{r}"),
                    rank=r,
                    step=world.committed,
                    pid=pid,
                    host=HOST,
                    waiting=True,
                )
                for r, pid in sorted(world.pids.items())
                if r != hung
            ]
            drive(log, engine, world, [*beats, *world.spare_heartbeats()])
    seen = len(log.read(Stream.DECISIONS, job_id))
    engine.apply(log.read(Stream.EVENTS, job_id, engine.next_position))  # the finding: decide
    decided = [e.record for e in log.read(Stream.DECISIONS, job_id)[seen:]]
    answers = [r for d in decided if isinstance(d, Decision) for r in world.react(d)]
    killed = RankExited(**world._env("agent"), rank=hung, pid=stopped_pid, signal=9)
    drive(log, engine, world, [*answers, killed])
    drive(log, engine, world, world.train(2))
    drive(log, engine, world, world.finish())
