"""The engine's checkpoint fallback (no torch): when no healthy replica holds a shard it names
the latest complete checkpoint, every member loads it, the incident closes with its RPO."""

from __future__ import annotations

from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.records import (
    CheckpointLoaded,
    Decision,
    Envelope,
    FallbackToCheckpoint,
    IncidentClosed,
    RankRegrouped,
    RegroupPlanned,
    ResumePlanned,
)
from flashrecovery.replay.replayer import replay_job
from flashrecovery.statemachines.job import JobState
from flashrecovery.testing.simworld import SimulatedWorld, drive

JOB = "fallback"


def started(world: SimulatedWorld) -> tuple[MemoryLog, EngineLoop]:
    """The engine over a memory log, the world's start applied."""
    log = MemoryLog()
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    return log, engine


def running(world_size: int, shards: int) -> tuple[MemoryLog, SimulatedWorld, EngineLoop]:
    world = SimulatedWorld(JOB, world_size=world_size, spares=2, shards=shards)
    log, engine = started(world)
    return log, world, engine


def of(decisions: list[Decision], cls: type[Decision]) -> list[Decision]:
    return [d for d in decisions if isinstance(d, cls)]


def test_pure_fsdp_falls_back_to_the_latest_checkpoint_and_carries_on() -> None:
    log, world, engine = running(world_size=2, shards=2)
    drive(log, engine, world, world.train(2))
    drive(log, engine, world, [world.checkpoint()])  # step 1
    drive(log, engine, world, world.train(2))
    drive(log, engine, world, [world.checkpoint()])  # step 3: the latest
    drive(log, engine, world, world.train(2))  # committed up to 5
    decisions = drive(log, engine, world, [world.kill(1)])
    [fallback] = of(decisions, FallbackToCheckpoint)
    assert isinstance(fallback, FallbackToCheckpoint)
    assert (fallback.step, fallback.path, fallback.shards) == (3, "/ckpt/step-3", [1])
    assert not of(decisions, ResumePlanned)
    assert engine.state.job.state == JobState.RESUMING
    assert {r: v.committed_step for r, v in engine.state.ranks.items()} == {0: 3, 1: 3}
    decisions = drive(log, engine, world, world.train(1))
    [closed] = of(decisions, IncidentClosed)
    assert isinstance(closed, IncidentClosed)
    assert (closed.rpo_steps, closed.recomputed_steps) == (2, 3)  # steps 4, 5 lost; 4..6 redone
    drive(log, engine, world, world.finish())
    assert engine.state.job.state == JobState.COMPLETED
    report = replay_job(log, JOB)
    assert report.ok
    [incident] = report.incidents()
    assert (incident["checkpoint_step"], incident["rpo_steps"]) == (3, 2)


def test_without_a_checkpoint_the_fallback_ends_the_job() -> None:
    log, world, engine = running(world_size=2, shards=2)
    drive(log, engine, world, world.train(3))
    [fallback] = of(drive(log, engine, world, [world.kill(0)]), FallbackToCheckpoint)
    assert isinstance(fallback, FallbackToCheckpoint)
    assert fallback.step is None and "no complete checkpoint" in fallback.reason
    assert engine.state.job.state == JobState.FALLBACK


def test_hsdp_one_shard_lost_with_all_its_replicas_falls_back() -> None:
    log, world, engine = running(world_size=4, shards=2)
    drive(log, engine, world, world.train(2))
    drive(log, engine, world, [world.checkpoint()])
    drive(log, engine, world, world.train(1))
    decisions = drive(log, engine, world, [world.kill(1), world.kill(3)])
    [fallback] = of(decisions, FallbackToCheckpoint)
    assert isinstance(fallback, FallbackToCheckpoint)
    assert (fallback.step, fallback.shards) == (1, [1])
    decisions = drive(log, engine, world, world.train(1))
    assert [c.rpo_steps for c in of(decisions, IncidentClosed)] == [1, 1]  # type: ignore[attr-defined]


def test_a_shard_with_a_replica_left_is_restored_from_it_not_the_checkpoint() -> None:
    log, world, engine = running(world_size=4, shards=2)
    drive(log, engine, world, world.train(2))
    drive(log, engine, world, [world.checkpoint()])
    drive(log, engine, world, world.train(1))
    decisions = drive(log, engine, world, [world.kill(1)])
    assert not of(decisions, FallbackToCheckpoint)
    [plan] = of(decisions, ResumePlanned)
    assert isinstance(plan, ResumePlanned) and plan.donors == {0: 0, 1: 3}


class LoadsTheWrongStepFirst(SimulatedWorld):
    def react(self, decision: Decision) -> list[Envelope]:
        if not isinstance(decision, FallbackToCheckpoint):
            return super().react(decision)
        wrong = CheckpointLoaded(
            job_id=JOB, generation=self.generation, source="rank:0", rank=0, step=0, ms=1.0
        )
        return [wrong, *super().react(decision)]


def test_a_checkpoint_of_an_uncommitted_step_or_a_load_of_another_step_is_rejected() -> None:
    world = LoadsTheWrongStepFirst(JOB, world_size=2, spares=1, shards=2)
    log, engine = started(world)
    drive(log, engine, world, world.train(2))
    world.committed = 5  # claims a step nobody committed
    drive(log, engine, world, [world.checkpoint()])
    assert engine.state.checkpoint is None
    assert engine.state.last_rejection.endswith("no member committed past 1")
    world.committed = 1
    drive(log, engine, world, [world.checkpoint()])
    drive(log, engine, world, [world.kill(1)])
    assert any("rank 0 loaded step 0, the plan is 1" in r for r in engine.state.rejected)
    assert engine.state.job.state == JobState.RESUMING  # the right loads were believed


class LosesRank0AsItLoads(SimulatedWorld):
    """Rank 0 dies as it starts loading the checkpoint the first fallback names; rank 1 loads
    it, and then regroups in the next generation holding the checkpoint's step."""

    lost_while_loading = False

    def react(self, decision: Decision) -> list[Envelope]:
        if isinstance(decision, FallbackToCheckpoint) and not self.lost_while_loading:
            assert decision.step is not None
            self.lost_while_loading, self.committed = True, decision.step
            loaded = CheckpointLoaded(**self._env("rank:1"), rank=1, step=decision.step, ms=5.0)
            return [self.kill(0), loaded]
        records = super().react(decision)
        if isinstance(decision, RegroupPlanned) and self.lost_while_loading:
            return [
                r.model_copy(update={"committed_step": self.committed})
                if isinstance(r, RankRegrouped) and r.rank == 1
                else r
                for r in records
            ]
        return records


def test_a_member_lost_while_the_checkpoint_loads_falls_back_again() -> None:
    world = LosesRank0AsItLoads(JOB, world_size=2, spares=2, shards=2)
    log, engine = started(world)
    drive(log, engine, world, world.train(4))
    drive(log, engine, world, [world.checkpoint()])  # step 3
    drive(log, engine, world, world.train(2))
    decisions = drive(log, engine, world, [world.kill(1)])
    fallbacks = of(decisions, FallbackToCheckpoint)
    assert [f.step for f in fallbacks] == [3, 3]  # type: ignore[attr-defined]
    assert not [r for r in engine.state.rejected if "says it holds step" in r]
    assert engine.state.job.state == JobState.RESUMING
    decisions = drive(log, engine, world, world.train(1))
    assert len(of(decisions, IncidentClosed)) == 2
    drive(log, engine, world, world.finish())
    assert engine.state.job.state == JobState.COMPLETED
    assert replay_job(log, JOB).ok
