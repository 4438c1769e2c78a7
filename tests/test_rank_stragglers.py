"""Ranks slower than their peers (engine/stragglers.py and what the engine decides from it),
pure: a steady slowdown names the rank once, a noisy one never does; the replace policy
replaces it with a spare in an incident that loses no committed step."""

from __future__ import annotations

import random

import pytest

from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.engine.stragglers import Change, StepScores
from flashrecovery.records import StragglerPolicy
from flashrecovery.replay.replayer import replay_job
from flashrecovery.testing.simworld import SimulatedWorld, drive

JOB = "stragglers"


def scored(scores: StepScores, times: dict[int, list[float]]) -> list[tuple[int, Change]]:
    """Feed each step's times (rank -> its time per step); the changes with their step."""
    changes = []
    steps = len(next(iter(times.values())))
    for step in range(steps):
        for rank, seconds in times.items():
            for change in scores.add(rank, step, seconds[step], len(times)):
                changes.append((step, change))
    return changes


def test_a_steady_slowdown_names_the_rank_once_its_window_is_full() -> None:
    scores = StepScores(window=5, ratio=2.0)
    changes = scored(scores, {0: [1.0] * 8, 1: [2.5] * 8, 2: [1.0] * 8})
    assert changes == [(4, Change(1, 2.5, found=True))]
    assert scores.named == {1}


def test_two_ranks_the_slower_is_measured_against_the_other() -> None:
    changes = scored(StepScores(window=3, ratio=1.5), {0: [0.2] * 3, 1: [0.1] * 3})
    assert changes == [(2, Change(0, 2.0, found=True))]


def test_a_noisy_rank_is_never_named() -> None:
    """Every rank's times jitter by up to 25 %, and one is 4x slow in one step of six at
    random: its median slowdown stays near 1."""
    rng = random.Random(3)

    def jitter() -> float:
        return rng.uniform(0.8, 1.25)

    noisy = [4.0 if rng.random() < 1 / 6 else jitter() for _ in range(200)]
    steady = {rank: [jitter() for _ in range(200)] for rank in (0, 2)}
    assert scored(StepScores(window=20, ratio=2.0), {**steady, 1: noisy}) == []


def test_a_named_rank_is_cleared_once_it_is_back_under_halfway() -> None:
    scores = StepScores(window=3, ratio=2.0)
    changes = scored(scores, {0: [1.0] * 9, 1: [3.0] * 3 + [1.6] * 3 + [1.2] * 3})
    assert changes == [(2, Change(1, 3.0, found=True)), (7, Change(1, 1.2, found=False))]


def test_a_step_some_member_never_reports_is_dropped() -> None:
    scores = StepScores(window=2, ratio=2.0)
    assert scores.add(0, 0, 1.0, members=2) == []  # rank 1 was lost in step 0
    for step in range(1, 5):
        scores.add(0, step, 1.0, members=2)
        scores.add(1, step, 1.0, members=2)
    assert list(scores.pending) == []


def started(
    policy: StragglerPolicy, spares: int = 1
) -> tuple[MemoryLog, SimulatedWorld, EngineLoop]:
    log = MemoryLog()
    world = SimulatedWorld(
        JOB, world_size=3, spares=spares, straggler_policy=policy, straggler_steps=3
    )
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(2))
    return log, world, engine


def test_the_report_policy_names_a_slow_rank_with_its_node_and_slowdown() -> None:
    log, world, engine = started(StragglerPolicy.REPORT)
    world.slowdown = {2: 3.0}
    decisions = drive(log, engine, world, world.train(6))
    [found] = [d for d in decisions if d.type == "straggler_found"]
    assert (found.node, found.ranks, found.cause, found.slowdown) == (0, [2], "step_time", 3.0)
    assert not found.replaced and found.reason == (
        "rank 2's steps take 3.00x its peers' median over its last 3 steps (at least 2.00x): "
        "named only (--straggler-policy report)"
    )
    assert not [d for d in decisions if d.type == "isolate_rank"]
    world.slowdown = {}
    decisions = drive(log, engine, world, world.train(4))
    [cleared] = [d for d in decisions if d.type == "straggler_cleared"]
    assert (cleared.rank, cleared.slowdown) == (2, 1.0)
    report = replay_job(log, JOB)
    assert report.ok, report.divergence and report.divergence.describe()


@pytest.mark.parametrize("spares", [1, 0])
def test_the_replace_policy_replaces_a_slow_rank_when_a_spare_is_free(spares: int) -> None:
    log, world, engine = started(StragglerPolicy.REPLACE, spares=spares)
    world.slowdown = {1: 2.5}
    decisions = drive(log, engine, world, world.train(4))
    [found] = [d for d in decisions if d.type == "straggler_found"]
    isolated = [d for d in decisions if d.type == "isolate_rank"]
    if spares:
        assert found.replaced and found.reason.endswith("replaced (--straggler-policy replace)")
        assert [(d.rank, d.reason.split(":")[0]) for d in isolated] == [(1, "rank 1 slows the job")]
        assert [d.type for d in decisions if d.type == "assign_spare"] == ["assign_spare"]
        world.slowdown = {}  # the replacement is as fast as its peers
        decisions = drive(log, engine, world, world.train(2))
        [closed] = [d for d in decisions if d.type == "incident_closed"]
        assert closed.rpo_steps == 0
    else:
        assert not found.replaced and found.reason.endswith("named only: no spare is free")
        assert isolated == []
    report = replay_job(log, JOB)
    assert report.ok, report.divergence and report.divergence.describe()
