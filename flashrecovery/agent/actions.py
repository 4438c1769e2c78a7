"""Carrying out the engine's decisions on processes (docs/protocol.md, "Recovery").

The engine decides; this module only acts: kill, hand a spare its rank, spawn a replacement,
refill the spare pool, and say which decision ends the job.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from flashrecovery.agent.supervisor import Supervisor
from flashrecovery.records import (
    AssignSpare,
    Decision,
    Envelope,
    FallbackToCheckpoint,
    IncidentClosed,
    IsolateRank,
    ReplacementSpawned,
    SpareActivated,
    SpawnReplacement,
)


class Actions:
    def __init__(
        self,
        supervisor: Supervisor,
        store: dist.Store,
        report: Callable[[Envelope], None],
        job_id: str,
        spares: int,
    ) -> None:
        self._supervisor = supervisor
        self._store = store
        self._report = report
        self._job_id = job_id
        self._spares = spares  # the pool size to keep
        self._done: set[str] = set()  # decision ids carried out (ids are deterministic)

    def apply(self, decision: Decision) -> str | None:
        """Carry out one decision, once even if the log holds it twice (two engines around a
        lease handover); returns why the job must end, if it must."""
        if decision.record_id in self._done:
            return None
        self._done.add(decision.record_id)
        if isinstance(decision, IsolateRank):
            if decision.kill and decision.pid is not None:
                self._supervisor.kill(decision.pid)
        elif isinstance(decision, AssignSpare):
            self._assign_spare(decision)
        elif isinstance(decision, SpawnReplacement):
            child = self._supervisor.spawn_rank(
                decision.rank, generation=decision.generation, replacement=True
            )
            self._report(
                ReplacementSpawned(**self._envelope(decision), rank=decision.rank, pid=child.pid)
            )
        elif isinstance(decision, IncidentClosed):
            # Refill only now: a spare starting up (import torch, warm-up) would compete for
            # the CPU with the recovery it is meant to speed up.
            for _ in range(self._spares - self._supervisor.idle_spares()):
                self._supervisor.spawn_spare()
        elif isinstance(decision, FallbackToCheckpoint):
            return f"fallback to checkpoint: {decision.reason}"
        return None

    def _assign_spare(self, decision: AssignSpare) -> None:
        child = self._supervisor.assign(decision.spare_id, decision.rank, decision.generation)
        if child is None:
            return  # not one of ours; the rank's regroup will time out and say so
        assignment = {"rank": decision.rank, "generation": decision.generation}
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
