"""Live non-finite steps (docs/hook.md, "Non-finite steps"): a NaN in one rank's gradients
(the ``nan`` fault, in the real tensor the commit looks at) stops the step on every rank; the
step is computed again; NaN again, the job's policy skips the batch everywhere or fails the
job naming the rank and step. Nothing of it is a failure of a process: no incident, no rank
replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from livejob import WORLD, JobResult, run_job
from test_live_ddp import DDP, ddp_reference  # noqa: F401 (a fixture)
from test_live_recovery import assert_lossless, assert_survivors_kept

from flashrecovery.records import NonFinitePolicy

pytestmark = pytest.mark.timeout(240)
STEP = 6


def nonfinite_reports(job: JobResult) -> list[tuple[int, int, str, int, str]]:
    records = job.records(type="step_nonfinite")
    return sorted((r.rank, r.step, r.found, r.attempt, r.action) for r in records)


def test_a_nan_once_is_recomputed_and_the_job_ends_as_without_it(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """The hook's own reduction: the NaN reaches every rank's sum; each rank reports it, the
    one it came from as its own."""
    job = run_job(tmp_path, fault_plan=[f"1:nan@{STEP}"])
    assert_lossless(job, reference, incidents=0)
    assert_survivors_kept(job, failed=set())
    assert nonfinite_reports(job) == [
        (rank, STEP, "gradients" if rank == 1 else "summed gradients", 1, "recompute")
        for rank in range(WORLD)
    ]
    assert not any(r.skipped for r in job.records(type="step_completed"))


def test_ddp_a_nan_in_one_ranks_gradients_stops_the_step_on_every_rank(
    tmp_path: Path,
    ddp_reference: torch.Tensor,  # noqa: F811 (the fixture)
) -> None:
    """DDP reduced the gradients before the NaN: only rank 1 sees it, and no rank steps."""
    job = run_job(tmp_path, fault_plan=[f"1:nan@{STEP}"], script_args=DDP)
    assert_lossless(job, ddp_reference, incidents=0)
    assert nonfinite_reports(job) == [(1, STEP, "gradients", 1, "recompute")]


def test_nan_again_skips_the_batch_on_every_rank(tmp_path: Path, reference: torch.Tensor) -> None:
    job = run_job(
        tmp_path,
        fault_plan=[f"1:nan@{STEP}", f"1:nan@{STEP}"],
        script_args=DDP,
        nonfinite_policy=NonFinitePolicy.SKIP,
    )
    assert job.exit_code == 0
    assert nonfinite_reports(job) == [
        (1, STEP, "gradients", 1, "recompute"),
        (1, STEP, "gradients", 2, "skip"),
    ]
    steps = job.records(type="step_completed")
    assert sorted((r.rank, r.step) for r in steps if r.skipped) == [(r, STEP) for r in range(WORLD)]
    finals = [job.final(rank)["params"] for rank in range(WORLD)]
    assert all(torch.equal(finals[0], final) for final in finals)
    assert finals[0].isfinite().all()
    assert job.decisions("incident_closed") == []


def test_nan_again_fails_the_job_naming_the_rank_and_the_step(tmp_path: Path) -> None:
    job = run_job(tmp_path, fault_plan=[f"2:nan@{STEP}", f"2:nan@{STEP}"], script_args=DDP)
    assert job.exit_code != 0
    [failed] = job.decisions("fail_job")
    assert "NonFiniteStepError" in failed.last_error
    assert f"step {STEP} was non-finite, and again when computed again" in failed.last_error
    assert "(rank 2: gradients); --nonfinite-policy fail" in failed.last_error
    assert job.decisions("incident_closed") == []
