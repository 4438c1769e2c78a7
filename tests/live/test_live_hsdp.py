"""Live recovery of HSDP (FSDP2 ``fully_shard`` on a 2 replicas x 2 shards DeviceMesh, 4 CPU
ranks, gloo): a lost rank is restored from the same shard of the other replica, only that
shard's state moves, ranks of different shards lost together are restored in parallel from
different donors, and the job ends bitwise equal to a fault-free run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from livejob import EXAMPLES, run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

pytestmark = pytest.mark.timeout(300)

HSDP = {"script": EXAMPLES / "train_hsdp.py", "nproc": 4, "shards": 2}


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    job = run_job(tmp_path_factory.mktemp("hsdp-reference"), **HSDP)  # type: ignore[arg-type]
    assert job.exit_code == 0
    params: torch.Tensor = job.final(0)["params"]
    return params


def run_hsdp(tmp_path: Path, **kwargs: Any) -> Any:
    return run_job(tmp_path, **HSDP, **kwargs)  # type: ignore[arg-type]


def assert_restored_from(
    job: Any, reference: torch.Tensor, rank: int, donor: int, donors: dict[int, int]
) -> None:
    """One incident: ``rank`` lost and restored from ``donor`` alone (the plan's ``donors``
    per shard), the others kept, the job bitwise equal to ``reference``."""
    assert_lossless(job, reference, incidents=1, world=4)
    assert_survivors_kept(job, failed={rank}, world=4)
    [plan] = job.decisions("resume_planned")
    assert (plan.donors, plan.recipients) == (donors, [rank])
    [moved] = job.records(type="state_transferred")
    assert (moved.rank, moved.donor) == (rank, donor)


def test_rank_restored_from_its_shards_replica(
    tmp_path: Path, hsdp_reference: torch.Tensor
) -> None:
    job = run_hsdp(tmp_path, spares=1, kill_at={1: 8})
    assert_restored_from(job, hsdp_reference, 1, 3, {0: 0, 1: 3})  # rank 3 holds shard 1 too


def test_rank_restored_on_a_reconfigured_mesh(tmp_path: Path, hsdp_reference: torch.Tensor) -> None:
    """``--group-rebuild reconfigure``: each of the mesh's groups (world, replicate, shard)
    keeps one backend, reconfigured in place to take the spare."""
    job = run_hsdp(tmp_path, spares=1, kill_at={2: 8}, group_rebuild="reconfigure")
    assert_lossless(job, hsdp_reference, incidents=1, world=4)
    assert_survivors_kept(job, failed={2}, world=4)
    [moved] = job.records(type="state_transferred")
    assert (moved.rank, moved.donor) == (2, 0)  # rank 0 holds shard 0 too


def test_two_shards_lost_together_restored_in_parallel(
    tmp_path: Path, hsdp_reference: torch.Tensor
) -> None:
    job = run_hsdp(tmp_path, spares=2, kill_at={0: 8, 3: 8})
    assert_lossless(job, hsdp_reference, incidents=len(job.decisions("incident_closed")), world=4)
    assert_survivors_kept(job, failed={0, 3}, world=4)
    last = job.decisions("resume_planned")[-1]
    assert (last.donors, last.recipients) == ({0: 2, 1: 1}, [0, 3])
    moved = job.records(type="state_transferred")
    assert {m.rank: m.donor for m in moved if m.generation == last.generation} == {0: 2, 3: 1}


def test_a_nan_in_one_shards_gradients_is_recomputed(
    tmp_path: Path, hsdp_reference: torch.Tensor
) -> None:
    """The commit looks at each rank's local shard of its DTensor gradients: rank 3's NaN stops
    the step on all four ranks, which compute it again (docs/hook.md, "Non-finite steps")."""
    job = run_hsdp(tmp_path, fault_plan=["3:nan@6"])
    assert_lossless(job, hsdp_reference, incidents=0, world=4)
    reports = job.records(type="step_nonfinite")
    assert [(r.rank, r.step, r.found, r.action) for r in reports] == [
        (3, 6, "gradients", "recompute")
    ]
