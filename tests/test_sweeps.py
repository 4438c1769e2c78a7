"""A recovery moves every member at once (pause for the new generation, resume all but the
recipients) as a sweep applied to each rank when it is next looked at (engine/state.py). Lazy
must mean invisible: an engine that looks at every rank after every record decides the same,
the aggregates always agree with the ranks, and the decisions that start and restore a
recovery leave the members they do not concern untouched."""

from __future__ import annotations

from collections import Counter

from factories import feed
from hypothesis import given
from test_decide_fuzz import FUZZ, SCRIPT, SPLICES, spliced

from flashrecovery.engine import detectors
from flashrecovery.engine.decide import decide
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Decision, Envelope
from flashrecovery.testing.simworld import SimulatedWorld

JOB = SCRIPT[0].job_id


def assert_aggregates_agree(state: EngineState) -> None:
    """The census, the committed-step index and the waiting count say what the ranks say."""
    views = dict(state.ranks.items())  # looking settles every rank
    assert +state.rank_census == +Counter(v.machine.state for v in views.values())
    assert +state.committed.counts == +Counter(state.committed.steps.values())
    assert all(views[r].committed_step == step for r, step in state.committed.steps.items())
    assert state.waiting == sum(v.waiting for v in views.values())


def histories(state: EngineState) -> dict[int, list[tuple[str, str, int]]]:
    return {
        r: [(step.trigger, step.dest, step.stamp.position) for step in v.machine.history]
        for r, v in state.ranks.items()
    }


class LazyAndEager:
    """Two engines fed the same records: one lazy, one that looks at every rank after each
    record (so every sweep reaches every rank at once); each record must decide alike."""

    def __init__(self) -> None:
        self.lazy, self.eager, self.position = EngineState(JOB), EngineState(JOB), 0

    def feed(self, records: list[Envelope]) -> list[Decision]:
        out: list[Decision] = []
        for record in records:
            decided = decide(self.lazy, self.position, record)
            assert decide(self.eager, self.position, record) == decided, record
            assert_aggregates_agree(self.eager)
            out += decided
            self.position += 1
        return out


def lazy_and_eager(records: list[Envelope]) -> None:
    engines = LazyAndEager()
    engines.feed(records)
    lazy, eager = engines.lazy, engines.eager
    assert histories(lazy) == histories(eager)
    assert (lazy.rejected, lazy.fenced, lazy.engine_faults) == (
        eager.rejected,
        eager.fenced,
        eager.engine_faults,
    )


def test_the_recovery_script_is_decided_alike_lazily_and_eagerly() -> None:
    lazy_and_eager(SCRIPT)


@given(SPLICES)
@FUZZ
def test_random_records_spliced_into_a_recovery_are_decided_alike(
    insertions: list[tuple[int, Envelope]],
) -> None:
    lazy_and_eager(spliced(insertions))


def untouched(state: EngineState) -> int:
    """Members the newest sweep has not reached yet."""
    return sum(v.swept < len(state.sweeps) for _, v in state.ranks.unsettled_items())


def test_starting_and_restoring_a_recovery_leaves_the_other_members_alone() -> None:
    """2,000 ranks, rank 1,000 killed: the plan of the new generation and the resume plan each
    touch the ranks they concern (the failed rank, the donors, the recipient), not the world;
    every member is still seen paused, then resumed, by whoever looks."""
    world_size = 2000
    world = SimulatedWorld(JOB, world_size=world_size, spares=1)
    state, position = EngineState(JOB), 0

    def step(records: list[Envelope]) -> list[Decision]:
        nonlocal position
        decisions = feed(state, records, position)
        position += len(records)
        assert not state.rejected and not state.engine_faults
        return decisions

    step(world.start())
    step(list(world.train(2)))
    planned = step([world.kill(world_size // 2)])
    assert [d.type for d in planned][-1] == "regroup_planned"
    assert untouched(state) >= world_size - 2  # the killed rank (and its replacement's) only
    assert state.rank_census["paused"] == world_size - 1

    pending = [a for d in planned for a in world.react(d)]
    resumed: list[Decision] = []
    while pending:  # every member regroups, the last report brings the resume plan, restore
        decisions = step(pending)
        resumed += decisions
        pending = [a for d in decisions for a in world.react(d)]
    plan = next(d for d in resumed if d.type == "resume_planned")
    assert plan.recipients == [world_size // 2]  # type: ignore[attr-defined]
    assert untouched(state) <= world_size - 1
    assert untouched(state) >= world_size - 1 - 4 - 1  # all but recipient, donors, last reporter
    assert state.rank_census["healthy"] == world_size
    assert {v.machine.state for v in state.ranks.values()} == {"healthy"}
    assert_aggregates_agree(state)


def test_a_member_silent_through_the_regroup_is_missed_when_an_eager_engine_would() -> None:
    """Rank 5 never answers the plan (stopped): its heartbeat before the plan would make it
    due early, but the plan restarts its silence watch, so it is missed a silence limit after
    the plan, not before, by the lazy engine as by one that looked at every rank at once."""
    world = SimulatedWorld(JOB, world_size=8, spares=1)
    engines = LazyAndEager()
    lazy, eager = engines.lazy, engines.eager
    engines.feed(world.start())
    engines.feed(list(world.train(2)))
    world.clock = round(world.clock + 2.0, 6)  # rank 5's last beat is now well in the past
    planned = engines.feed([world.kill(3)])
    plan_ts = world.clock
    answers = [a for d in planned for a in world.react(d)]
    engines.feed([a for a in answers if getattr(a, "rank", None) != 5])
    assert lazy.config is not None
    limit = lazy.config.silence_limit_s

    def missed(state: EngineState, now: float) -> list[tuple[int, float]]:
        return [(f.rank, f.last_seen_ts) for f in detectors.silent_ranks(state, now)]

    early, due = plan_ts + limit - 0.01, plan_ts + limit + 0.01
    assert missed(lazy, early) == missed(eager, early) == []
    found = missed(lazy, due)
    assert found == missed(eager, due)
    assert (5, plan_ts) in found  # timed from the plan, not from its last beat
