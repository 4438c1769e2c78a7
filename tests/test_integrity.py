"""The engine's comparison of the replicas' state digests (engine/integrity.py) and what it
decides from them (engine/decide.py): pure, on a simulated world."""

from __future__ import annotations

from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine import integrity
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.records import StateDigest
from flashrecovery.replay.replayer import replay_job
from flashrecovery.testing.simworld import SimulatedWorld, drive

JOB = "integrity"


def test_a_minority_of_a_shard_is_named_with_the_digests_and_the_step() -> None:
    reports = {0: (0, "good"), 1: (0, "bad"), 2: (0, "good"), 3: (1, "x"), 4: (1, "x")}
    outcome = integrity.compare(reports, 12)
    assert (outcome.odd, outcome.undecided) == ([1], [])
    assert outcome.reason == (
        "replicas' states differ at step 12 (shard 0: rank 1 bad against good of the other 2)"
    )


def test_a_shard_without_a_majority_is_undecided_and_every_replica_odd() -> None:
    outcome = integrity.compare({0: (0, "a"), 1: (0, "b"), 2: (1, "c"), 3: (1, "c")}, 4)
    assert (outcome.odd, outcome.undecided) == ([0, 1], [0])
    assert "shard 0: rank 0 a, rank 1 b, no majority" in outcome.reason


def test_alike_replicas_are_nothing_to_do() -> None:
    outcome = integrity.compare({0: (0, "a"), 1: (0, "a")}, 4)
    assert (outcome.odd, outcome.reason) == ([], "")


def digests(world: SimulatedWorld, held: list[str]) -> list[StateDigest]:
    step = world.committed + 1
    return [
        StateDigest(job_id=JOB, generation=world.generation, source=f"rank:{r}", rank=r,
                    step=step, shard=0, digest=d)
        for r, d in enumerate(held)
    ]  # fmt: skip


def started(world_size: int, spares: int) -> tuple[MemoryLog, SimulatedWorld, EngineLoop]:
    log, world = MemoryLog(), SimulatedWorld(JOB, world_size=world_size, spares=spares)
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(3))
    return log, world, engine


def test_the_engine_replaces_the_minority_once_every_member_reported() -> None:
    log, world, engine = started(3, spares=1)
    reports = digests(world, ["good", "bad", "good"])
    assert drive(log, engine, world, reports[:2]) == []  # not every member's yet
    decisions = drive(log, engine, world, reports[2:])
    isolated = [d for d in decisions if d.type == "isolate_rank"]
    assert [(d.rank, d.reason) for d in isolated] == [
        (1, "replicas' states differ at step 3 (shard 0: rank 1 bad against good of the other 2)")
    ]
    assert "regroup_planned" in [d.type for d in decisions]
    report = replay_job(log, JOB)
    assert report.ok, report.divergence and report.divergence.describe()


def test_two_replicas_that_differ_without_a_checkpoint_fail_the_job_naming_both() -> None:
    log, world, engine = started(2, spares=1)
    decisions = drive(log, engine, world, digests(world, ["a", "b"]))
    [failed] = [d for d in decisions if d.type == "fail_job"]
    assert failed.reason == (
        "replicas' states differ at step 3 (shard 0: rank 0 a, rank 1 b, no majority); "
        "no complete checkpoint to fall back to"
    )
    assert not [d for d in decisions if d.type == "regroup_planned"]


def test_a_digest_of_another_step_or_shard_is_rejected() -> None:
    log, world, engine = started(2, spares=0)
    wrong_step = digests(world, ["a"])[0].model_copy(update={"step": 7})
    wrong_shard = digests(world, ["a"])[0].model_copy(update={"shard": 1})
    assert drive(log, engine, world, [wrong_step, wrong_shard]) == []
    reasons = " | ".join(engine.state.rejected)
    assert "its step in progress is 3, not 7" in reasons and "holds shard 0, not 1" in reasons


def test_a_restore_that_fails_its_check_replaces_the_recipient_from_another_donor() -> None:
    """Rank 1 lost; its spare's restore from rank 0 fails its check: the spare is replaced in
    turn, and the next plan's donor is rank 2, the replica nobody suspects."""
    log, world, engine = started(3, spares=2)
    world.garbled_restores = 1
    decisions = drive(log, engine, world, [world.kill(1)])
    plans = [d for d in decisions if d.type == "resume_planned"]
    assert [p.stripes for p in plans] == [{0: [0, 2]}, {}]
    assert [p.donors for p in plans] == [{0: 0}, {0: 2}]
    isolated = [d for d in decisions if d.type == "isolate_rank"]
    assert [d.rank for d in isolated] == [1, 1]
    assert isolated[1].reason.startswith("rank 1's restore failed its check: 1 of the 8 tensors")
    decisions += drive(log, engine, world, world.train(2))
    assert [d.type for d in decisions].count("incident_closed") == 2
    assert engine.state.suspect_donors == {0}
    report = replay_job(log, JOB)
    assert report.ok, report.divergence and report.divergence.describe()


def test_a_restore_check_that_leaves_no_trusted_replica_falls_back() -> None:
    """Two replicas: the only donor is suspect, so the replaced recipient's shard has none
    left; without a checkpoint the fallback names none, and the job ends."""
    log, world, engine = started(2, spares=2)
    world.garbled_restores = 1
    decisions = drive(log, engine, world, [world.kill(1)])
    [fallback] = [d for d in decisions if d.type == "fallback_to_checkpoint"]
    assert "no healthy replica holds shard(s) [0]" in fallback.reason and fallback.step is None
    assert engine.state.job.state == "fallback"
