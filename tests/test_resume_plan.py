"""The resume plan (engine/planner.py), pure: which step, which donors, how they stripe."""

from __future__ import annotations

import pytest

from flashrecovery.engine import planner
from flashrecovery.engine.state import MAX_STRIPES, EngineState, RankView
from flashrecovery.statemachines.rank import RankMachine


def regrouped(
    shards: int, steps: dict[int, int], lost: frozenset[int] | set[int] = frozenset()
) -> EngineState:
    """Ranks regrouped at ``steps``, shard = rank % shards; ``lost`` replaced."""
    state = EngineState(job_id="plan")
    state.needs_state |= lost
    for rank, step in steps.items():
        state.ranks[rank] = RankView(RankMachine(f"rank:{rank}"), shard=rank % shards)
        state.regroups.report(rank, step, rank % shards, rank not in lost)
    return state


def test_pure_dp_stripes_across_every_survivor() -> None:
    plan = planner.plan_resume(regrouped(1, {0: 7, 1: -1, 2: 7}, lost={1}))
    assert plan == planner.ResumePlan(7, {0: 0}, [1], {0: [0, 2]})


def test_one_survivor_sends_alone_and_records_no_stripes() -> None:
    plan = planner.plan_resume(regrouped(1, {0: -1, 1: 7}, lost={0}))
    assert plan == planner.ResumePlan(7, {0: 1}, [0], {})


def test_each_shard_stripes_across_its_own_replicas() -> None:
    """HSDP 3 replicas x 2 shards: rank 2 (shard 0) lost, shard 0 has ranks 0 and 4 left."""
    steps: dict[int, int] = {r: 5 for r in range(6)}
    steps[2] = -1
    plan = planner.plan_resume(regrouped(2, steps, lost={2}))
    assert plan == planner.ResumePlan(5, {0: 0, 1: 1}, [2], {0: [0, 4], 1: [1, 3, 5]})


def test_only_survivors_at_the_resume_step_donate() -> None:
    """Rank 3 is one step behind: it receives, it does not donate."""
    plan = planner.plan_resume(regrouped(1, {0: 8, 1: -1, 2: 8, 3: 7}, lost={1}))
    assert isinstance(plan, planner.ResumePlan)
    assert (plan.stripes, plan.recipients) == ({0: [0, 2]}, [1, 3])


def test_stripes_are_capped() -> None:
    world = MAX_STRIPES + 3
    plan = planner.plan_resume(regrouped(1, {r: 4 if r else -1 for r in range(world)}, {0}))
    assert isinstance(plan, planner.ResumePlan)
    assert plan.stripes == {0: list(range(1, MAX_STRIPES + 1))}


@pytest.mark.parametrize("lost", [{0, 2}, {0, 1, 2, 3}])
def test_a_shard_without_a_replica_has_no_donor(lost: set[int]) -> None:
    steps: dict[int, int] = {r: (-1 if r in lost else 3) for r in range(4)}
    assert planner.plan_resume(regrouped(2, steps, lost)) == planner.NoReplica(
        [0] if lost == {0, 2} else [0, 1]
    )


def test_suspect_donors_give_no_state_while_another_replica_can() -> None:
    """HSDP 3 replicas x 2 shards, rank 2 replaced again after donor 0 sent it what failed its
    check: shard 0 is given by rank 4 alone, shard 1 as before."""
    state = regrouped(2, {0: 5, 1: 5, 2: -1, 3: 5, 4: 5, 5: 5}, lost={2})
    state.suspect_donors = {0}
    assert planner.plan_resume(state) == planner.ResumePlan(5, {0: 4, 1: 1}, [2], {1: [1, 3, 5]})


def test_a_shard_whose_every_replica_is_suspect_has_no_donor() -> None:
    state = regrouped(1, {0: 5, 1: -1, 2: 5}, lost={1})
    state.suspect_donors = {0, 2}
    assert planner.plan_resume(state) == planner.NoReplica([0])


def test_suspects_beyond_the_lowest_still_leave_every_other_replica() -> None:
    world = MAX_STRIPES + 3
    state = regrouped(1, {r: 4 if r else -1 for r in range(world)}, {0})
    state.suspect_donors = set(range(1, MAX_STRIPES + 1))  # every donor of the first plan
    plan = planner.plan_resume(state)
    assert isinstance(plan, planner.ResumePlan)
    assert plan.stripes == {0: [MAX_STRIPES + 1, MAX_STRIPES + 2]}
