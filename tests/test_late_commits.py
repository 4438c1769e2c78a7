"""Members that go on training until a plan reaches them (no torch): a rank replaced while
alive (a straggler, by policy) leaves its peers committing steps in their generation until
they hear of the plan; their regroup then says they hold those steps, which their fenced step
records show, and the engine believes it (nemesis, the network test: two steps past the plan,
rejected as "no member committed past", hung the incident for 120 s)."""

from __future__ import annotations

from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.records import (
    Decision,
    Envelope,
    IncidentClosed,
    RegroupPlanned,
    ResumePlanned,
    StepCompleted,
)
from flashrecovery.replay.replayer import replay_job
from flashrecovery.statemachines.job import JobState
from flashrecovery.testing.simworld import SimulatedWorld, drive

JOB = "late"


class TrainsOnUntilThePlanArrives(SimulatedWorld):
    """The survivors commit ``late`` more steps in the old generation before they regroup;
    ``claim_more`` makes them say they hold one step more than they committed."""

    late: int = 2
    claim_more: int = 0

    def react(self, decision: Decision) -> list[Envelope]:
        if not isinstance(decision, RegroupPlanned):
            return super().react(decision)
        survivors = [r for r in decision.members if r not in decision.replaced]
        committed: list[Envelope] = []
        for _ in range(self.late):
            self.committed += 1
            committed += [
                StepCompleted(
                    **self._env(f"rank:{r}"),
                    rank=r,
                    step=self.committed,
                    duration_s=self.step_s,
                    loss=0.5,
                )
                for r in survivors
            ]
        self.committed += self.claim_more
        return [*committed, *super().react(decision)]


def run(world: TrainsOnUntilThePlanArrives) -> tuple[MemoryLog, EngineLoop, list[Decision]]:
    log = MemoryLog()
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(5))
    return log, engine, drive(log, engine, world, [world.kill(1)])


def test_steps_committed_after_the_plan_are_held_and_the_job_resumes_there() -> None:
    world = TrainsOnUntilThePlanArrives(JOB, world_size=3, spares=1, shards=1)
    log, engine, decisions = run(world)
    assert not [r for r in engine.state.rejected if "says it holds step" in r]
    [resume] = [d for d in decisions if isinstance(d, ResumePlanned)]
    assert resume.resume_step == 4 + 2  # steps 0-4 trained, 5 and 6 committed after the plan
    decisions = drive(log, engine, world, world.train(1))
    assert [d for d in decisions if isinstance(d, IncidentClosed)]
    drive(log, engine, world, world.finish())
    assert engine.state.job.state == JobState.COMPLETED
    assert replay_job(log, JOB).ok


def test_a_claim_past_every_step_record_is_still_rejected() -> None:
    world = TrainsOnUntilThePlanArrives(JOB, world_size=3, spares=1, shards=1)
    world.claim_more = 2
    _, engine, decisions = run(world)
    said = [r for r in engine.state.rejected if "says it holds step 8" in r]
    assert said and "committed past 6" in said[0]
    assert not [d for d in decisions if isinstance(d, ResumePlanned)]
