"""Carrying out the engine's decisions on processes (docs/protocol.md, "Recovery").

The engine decides; this module only acts: kill, hand a spare its rank, spawn a replacement,
keep the spare pool full, and say which decision ends the job. Every node's agent reads every
decision and carries out those that name its node. New processes are started no
faster than a bounded rate, so nothing can fork without end, whatever the decisions say.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog
import torch.distributed as dist

from flashrecovery.agent.supervisor import Supervisor
from flashrecovery.records import (
    AssignSpare,
    AwaitNode,
    Decision,
    Envelope,
    FailJob,
    FallbackToCheckpoint,
    IncidentClosed,
    IsolateNode,
    IsolateRank,
    ReplacementSpawned,
    RetireSpare,
    SpareActivated,
    SpawnReplacement,
)

log = structlog.get_logger("flashrecovery.agent")

SPAWNS_PER_S = 2.0  # new processes per second, past a burst of one per rank and spare
NODE_ACTIONS = (IsolateRank, AssignSpare, SpawnReplacement, RetireSpare)  # one node's agent acts


class SpawnBudget:
    """A token bucket: ``burst`` processes at once, then ``rate`` per second."""

    def __init__(self, burst: int, rate: float, clock: Callable[[], float] = time.monotonic):
        self._burst, self._rate, self._clock = float(burst), rate, clock
        self._tokens, self._at = float(burst), clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class Actions:
    def __init__(
        self,
        supervisor: Supervisor,
        store: dist.Store,
        meeting: Callable[[], str],
        report: Callable[[Envelope], None],
        job_id: str,
        spares: int,
        budget: SpawnBudget,
        *,
        refill_at_once: bool = True,
        node: int = 0,
        say: Callable[[str], None] = print,
    ) -> None:
        self._supervisor = supervisor
        self._store = store  # this node's own: its spares wait for their rank there
        self._meeting = meeting  # where the generation a spare joins meets
        self._report = report
        self._job_id = job_id
        self._spares = spares  # the pool size to keep
        self._refill_at_once = refill_at_once  # a taken spare is replaced at once
        self._budget = budget
        self._deferred: deque[Callable[[], object]] = deque()  # spawns waiting for the budget
        self._done: set[str] = set()  # decision ids carried out (ids are deterministic)
        self._node = node
        self._say = say
        self.lost_nodes: set[int] = set()

    def apply(self, decision: Decision) -> str | None:
        """Carry out one decision, once even if the log holds it twice (two engines around a
        lease handover); returns why the job must end, if it must."""
        if decision.record_id in self._done:
            return None
        self._done.add(decision.record_id)
        if isinstance(decision, IsolateNode):
            self.lost_nodes.add(decision.node)
            if decision.node == self._node:
                return f"this node was declared lost: {decision.reason}"
        elif isinstance(decision, AwaitNode):
            self._say(
                f"flashrecovery: rank(s) {', '.join(map(str, decision.ranks))} have no spare: "
                f"waiting up to {decision.node_wait_s:.0f}s for a node to join (--node-wait)"
            )
        elif isinstance(decision, NODE_ACTIONS) and decision.node != self._node:
            if isinstance(decision, AssignSpare | SpawnReplacement):
                self._supervisor.release(decision.rank)  # held on another node from now on
        elif isinstance(decision, IsolateRank):
            if decision.kill and decision.pid is not None:
                self._supervisor.kill(decision.pid)
        elif isinstance(decision, AssignSpare):
            self._assign_spare(decision)
            if self._refill_at_once:
                self._spawn(self._supervisor.spawn_spare)
        elif isinstance(decision, SpawnReplacement):
            self._spawn(lambda: self._spawn_replacement(decision))
        elif isinstance(decision, RetireSpare):
            if decision.pid is not None:
                self._supervisor.kill(decision.pid)
            if decision.refill:
                self._spawn(self._supervisor.spawn_spare)
            else:
                self._say(f"flashrecovery: spare {decision.spare_id} {decision.reason}")
        elif isinstance(decision, IncidentClosed):
            for _ in range(self._spares - self._supervisor.idle_spares() - len(self._deferred)):
                self._spawn(self._supervisor.spawn_spare)
        elif isinstance(decision, FallbackToCheckpoint):
            if decision.step is None:
                return f"fallback to checkpoint: {decision.reason}"
            self._say(
                f"flashrecovery: {decision.reason}: every rank loads the checkpoint of step "
                f"{decision.step} ({decision.path})"
            )
        elif isinstance(decision, FailJob):
            return f"{decision.reason}; last error: {decision.last_error}"
        return None

    def tick(self) -> None:
        """Start the deferred processes the budget allows now (called between decisions)."""
        while self._deferred and self._budget.take():
            self._deferred.popleft()()

    def _spawn(self, start: Callable[[], object]) -> None:
        self._deferred.append(start)
        self.tick()

    def _spawn_replacement(self, decision: SpawnReplacement) -> None:
        child = self._supervisor.spawn_rank(
            decision.rank, generation=decision.generation, replacement=True, meet=decision.store
        )
        self._report(
            ReplacementSpawned(**self._envelope(decision), rank=decision.rank, pid=child.pid)
        )

    def _assign_spare(self, decision: AssignSpare) -> None:
        child = self._supervisor.assign(decision.spare_id, decision.rank, decision.generation)
        if child is None:
            return  # not one of ours; the rank's regroup will time out and say so
        if not child.runnable:
            # Stopped since its last beat: it would hold the rank up until its silence is
            # found. Killed now, its exit is the replacement's death: the engine places again.
            log.warning("spare_unrunnable", spare_id=decision.spare_id, pid=child.pid)
            self._supervisor.kill(child.pid)
            return
        assignment = {
            "rank": decision.rank,
            "generation": decision.generation,
            "store": decision.store or self._meeting(),
        }
        self._store.set(f"spare/{decision.spare_id}", json.dumps(assignment))
        self._report(
            SpareActivated(
                **self._envelope(decision),
                spare_id=decision.spare_id,
                rank=decision.rank,
                pid=child.pid,
            )
        )

    def _envelope(self, decision: Decision) -> dict[str, Any]:
        return {"job_id": self._job_id, "generation": decision.generation, "source": "agent"}
