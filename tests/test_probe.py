"""The fault probe: one plan from the launch environment, each fault fired once in the job where
it is due, nothing at all without a plan; never part of the public API."""

from __future__ import annotations

import pytest

import flashrecovery.trainer_hooks as hook
from flashrecovery.trainer_hooks.probe import (
    ENV,
    Action,
    FaultPlan,
    InjectedFault,
    PlannedFault,
    Point,
    Probe,
)


def test_a_plan_round_trips_through_its_spec_and_names_where_each_fault_acts() -> None:
    plan = FaultPlan.from_environ({ENV: "1:raise@4,0:donor_send@7,2:hang@3"})
    assert plan.spec() == "1:raise@4,0:donor_send@7,2:hang@3"
    assert [(f.rank, f.point, f.action, f.step) for f in plan.faults] == [
        (1, Point.BEFORE_REDUCE, Action.RAISE, 4),
        (0, Point.DONOR_SEND, Action.KILL, 7),
        (2, Point.BEFORE_REDUCE, Action.HANG, 3),
    ]
    assert FaultPlan.from_environ({}) == FaultPlan()


@pytest.mark.parametrize("spec", ["1:raise", "raise@3", "x:raise@3", "1:explode@3", "1:raise@-1"])
def test_a_malformed_entry_is_refused_with_the_expected_form(spec: str) -> None:
    with pytest.raises(ValueError, match=r"expected <rank>:<kind>@<step>, kind one of"):
        FaultPlan.parse(spec)


def test_without_a_plan_the_probe_never_claims_anything() -> None:
    claims: list[int] = []
    probe = Probe(FaultPlan(), lambda index: claims.append(index) is None)
    for point in Point:
        probe(point, 0, 0)
    assert claims == []


def test_a_due_fault_fires_once_in_the_job_and_only_where_it_is_due() -> None:
    claimed: set[int] = set()

    def claim(index: int) -> bool:  # the job's store: the first claim of an index wins
        first = index not in claimed
        claimed.add(index)
        return first

    probe = Probe(FaultPlan((PlannedFault(1, Point.BEFORE_REDUCE, Action.RAISE, 4),)), claim)
    probe(Point.BEFORE_REDUCE, 0, 4)  # another rank
    probe(Point.BEFORE_REDUCE, 1, 3)  # another step
    probe(Point.AFTER_REDUCE, 1, 4)  # another point
    probe(Point.BEFORE_REDUCE, None, 4)  # a spare with no rank yet
    assert claimed == set()
    with pytest.raises(InjectedFault, match="step 4"):
        probe(Point.BEFORE_REDUCE, 1, 4)
    probe(Point.BEFORE_REDUCE, 1, 4)  # its replacement, recomputing the step: claimed already


def test_fault_injection_is_not_in_the_public_api() -> None:
    assert not {"InjectedFault", "Probe", "FaultPlan"} & set(hook.__all__)
