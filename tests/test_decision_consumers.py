"""The consumers of decisions: the agent carries each out once, the hook keeps following
through a log outage."""

from __future__ import annotations

import threading
from typing import Any

from flashrecovery.agent.actions import Actions, SpawnBudget
from flashrecovery.connectors.base import Entry
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.errors import LogError
from flashrecovery.records import Envelope, RegroupPlanned, SpawnReplacement, Stream
from flashrecovery.trainer_hooks.decisions import DecisionFollower

JOB = "consumers"


class Child:
    pid = 4242


class CountingSupervisor:
    """Stands in for the process pool: counts what it is asked to do."""

    def __init__(self) -> None:
        self.spawned: list[int] = []

    def spawn_rank(self, rank: int, **_: Any) -> Child:
        self.spawned.append(rank)
        return Child()


def test_a_decision_written_twice_is_carried_out_once() -> None:
    supervisor, reports = CountingSupervisor(), []
    actions = Actions(
        supervisor,  # type: ignore[arg-type]
        store=None,  # type: ignore[arg-type]
        report=reports.append,
        job_id=JOB,
        spares=0,
        budget=SpawnBudget(1, 1.0),
    )
    spawn = SpawnReplacement(
        record_id=f"{JOB}:7:1", job_id=JOB, generation=1, source="engine", caused_by=7, rank=2
    )
    assert actions.apply(spawn) is None
    assert actions.apply(spawn.model_copy()) is None  # the same id again, from a second engine
    assert supervisor.spawned == [2]
    assert [r.type for r in reports] == ["replacement_spawned"]


class FlakyLog(MemoryLog):
    """A log that fails its next few follows, as a restarting broker does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def follow(
        self, stream: Stream, job_id: str, from_position: int, timeout: float
    ) -> list[Entry]:
        if self.failures > 0:
            self.failures -= 1
            raise LogError("broker away")
        return super().follow(stream, job_id, from_position, timeout)


def test_the_hook_keeps_following_decisions_through_a_log_outage() -> None:
    log = FlakyLog(failures=2)
    regrouped = threading.Event()
    follower = DecisionFollower(log, JOB, on_regroup=lambda generation: regrouped.set())
    follower.start()
    try:
        plan: Envelope = RegroupPlanned(
            job_id=JOB, generation=1, source="engine", caused_by=3, members=[0, 1], replaced=[1]
        )
        log.append(Stream.DECISIONS, plan)
        assert regrouped.wait(10), "the follower died on the log error"
        assert follower.wait_regroup(after=0, timeout=1).generation == 1
        assert log.failures == 0
    finally:
        follower.stop()
