"""The consumers of decisions: the agent carries each out once, the hook follows what its
agent relays."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from flashrecovery.agent.actions import Actions, SpawnBudget
from flashrecovery.agent.links import ProcessLinks
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.records import RegroupPlanned, SpawnReplacement
from flashrecovery.trainer_hooks.agent_link import AgentLink
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
        meeting=lambda: "127.0.0.1:1",
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


def test_the_hooks_follower_acts_on_what_its_agent_relays(tmp_path: Path) -> None:
    """A rank takes its decisions from its agent (agent/links.py), never from the log: a relayed
    regroup plan reaches the follower, which releases the training thread at once."""
    links = ProcessLinks(tmp_path, MemoryLog(), patience_s=5.0)
    link = AgentLink(links.path)
    regrouped = threading.Event()
    follower = DecisionFollower(link, on_regroup=lambda generation: regrouped.set())
    follower.start()
    try:
        links.relay(
            RegroupPlanned(
                job_id=JOB, generation=1, source="engine", caused_by=3, members=[0, 1], replaced=[1]
            )
        )
        assert regrouped.wait(10), "the relayed plan did not reach the follower"
        assert follower.wait_regroup(after=0, timeout=1).generation == 1
    finally:
        follower.stop()  # first: a follower whose agent is gone ends its process
        link.close()
        links.close(5.0)
