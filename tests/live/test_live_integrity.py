"""Live replicas vouching for each other (docs/hook.md, "Replicas vouch for each other"): one
bit of one rank's parameters flipped in its memory (the ``bitflip`` fault) is found by the next
step whose vote compares the replicas' state digests; with three replicas the odd one is
replaced and restored from the others, and the job ends bitwise equal to a fault-free run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from livejob import run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

pytestmark = pytest.mark.timeout(240)


def test_a_flipped_bit_is_found_and_the_odd_replica_restored(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """Verified every 4 steps, flipped at step 7: found in that step's vote, before any rank
    stepped with it."""
    job = run_job(tmp_path, spares=1, fault_plan=["1:bitflip@7"], verify_every=4)
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    reports = job.records(type="state_digest")
    assert sorted((r.rank, r.step) for r in reports) == [(0, 7), (1, 7), (2, 7)]
    held = {r.rank: r.digest for r in reports}
    assert held[0] == held[2] != held[1]
    [isolated] = job.decisions("isolate_rank")
    assert isolated.rank == 1
    assert isolated.reason == (
        f"replicas' states differ at step 7 (shard 0: rank 1 {held[1]} against {held[0]} of "
        "the other 2)"
    )
    [moved] = job.records(type="state_transferred")
    assert moved.rank == 1 and moved.donor in (0, 2)


def test_two_replicas_that_differ_end_the_job_in_one_line(tmp_path: Path) -> None:
    job = run_job(tmp_path, nproc=2, spares=1, fault_plan=["0:bitflip@3"], verify_every=4)
    assert job.exit_code != 0
    [failed] = job.decisions("fail_job")
    assert failed.reason.startswith("replicas' states differ at step 3 (shard 0: rank 0 ")
    assert failed.reason.endswith("no majority); no complete checkpoint to fall back to")
    assert job.decisions("regroup_planned") == []


def test_a_restore_garbled_on_the_way_is_refused_and_redone_from_another_donor(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """Rank 1 killed at step 6; of its two donors, rank 2 flips a bit of what it sends (the
    ``garble`` fault, its own state untouched): the recipient's check names rank 2 before
    anything is loaded, the recipient is replaced by the second spare, restored from rank 0
    alone, and the job ends bitwise equal to a fault-free run."""
    job = run_job(tmp_path, spares=2, fault_plan=["1:before_reduce@6", "2:garble@5"])
    assert_lossless(job, reference, incidents=2)
    assert_survivors_kept(job, failed={1})
    [rejected] = job.records(type="restore_rejected")
    assert (rejected.rank, rejected.step, rejected.donors, rejected.tensors) == (1, 5, [2], 1)
    plans = job.decisions("resume_planned")
    assert [(p.donors, p.stripes) for p in plans] == [({0: 0}, {0: [0, 2]}), ({0: 0}, {})]
    [moved] = job.records(type="state_transferred")
    assert (moved.rank, moved.donor, list(moved.donor_bytes)) == (1, 0, [0])
    isolated = job.decisions("isolate_rank")
    assert [d.rank for d in isolated] == [1, 1]
    assert isolated[1].reason.startswith("rank 1's restore failed its check: 1 of the ")
