"""Faults during a recovery: the donor, the replacement or another member lost while the job
recovers from a first failure. Each ends in a completed job bitwise equal to a fault-free run,
the survivors in their own processes, a replay with no divergence and no process left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from livejob import run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

pytestmark = pytest.mark.timeout(240)
FIRST = "1:before_reduce@8"  # rank 1 dies before step 8: every member committed step 7


def test_donor_killed_mid_transfer_another_replica_donates(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    job = run_job(tmp_path, spares=1, fault_plan=[FIRST, "0:donor_send@7"])
    assert_lossless(job, reference, incidents=2)
    assert_survivors_kept(job, failed={0, 1})
    resume = job.decisions("resume_planned")
    # Rank 0 donated first and died after the header; rank 2 then restores both.
    assert [(p.resume_step, p.donors, p.recipients) for p in resume] == [
        (7, {0: 0}, [1]),
        (7, {0: 2}, [0, 1]),
    ]
    assert {(t.rank, t.donor) for t in job.records(type="state_transferred")} == {(0, 2), (1, 2)}


def test_replacement_killed_before_its_first_commit(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """The same planned fault twice: the spare that took rank 1 over dies where rank 1 did,
    after it received the state and before its first commit; a fresh process takes over (the
    pool is refilled only once the recovery is over: a refill forked in time would take it)."""
    job = run_job(tmp_path, spares=1, fault_plan=[FIRST, FIRST], spare_refill="after-recovery")
    assert_lossless(job, reference, incidents=2)
    assert_survivors_kept(job, failed={1})
    [activated] = job.records(type="spare_activated")
    [spawned] = job.records(type="replacement_spawned")
    assert activated.rank == spawned.rank == 1
    assert job.final(1)["pid"] == spawned.pid
    # Both received the state; only the fresh process ever committed a step as rank 1.
    transfers = job.records(type="state_transferred")
    assert [(t.rank, t.donor, t.generation) for t in transfers] == [(1, 0, 1), (1, 0, 2)]
    assert all(s.generation != 1 for s in job.records(type="step_completed") if s.rank == 1)


def test_second_rank_killed_during_regroup(tmp_path: Path, reference: torch.Tensor) -> None:
    job = run_job(tmp_path, spares=2, fault_plan=[FIRST, "2:regroup@7"])
    assert_lossless(job, reference, incidents=2)
    assert_survivors_kept(job, failed={1, 2})
    assert [i.failed_rank for i in job.decisions("incident_closed")] == [1, 2]
    assert [r.generation for r in job.decisions("regroup_planned")] == [1, 2]


def test_member_lost_while_the_group_forms_is_given_up_on_the_next_plan(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """Rank 2 dies as it starts to build generation 1's group: its ring neighbours (with 3
    ranks, everyone) waiting for it keep beating, and give up as soon as the engine plans
    generation 2 (not after the 60 s collective timeout)."""
    job = run_job(tmp_path, spares=2, fault_plan=[FIRST, "2:group_build@7"])
    assert_lossless(job, reference, incidents=2)
    assert_survivors_kept(job, failed={1, 2})
    gave_up = [e for e in job.records(type="collective_error") if e.generation == 1]
    assert {e.rank for e in gave_up} == {0, 1}
    assert all("generation 1 was superseded while its group formed" in e.error for e in gave_up)
    assert job.records(type="heartbeat_missed") == []
