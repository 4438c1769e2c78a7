"""Live recovery of pipeline parallel with data-parallel replicas of each stage
(examples/train_pp.py: ``torch.distributed.pipelining``, a stage per rank, GPipe or 1F1B over 2
microbatches, each stage in DDP over the mesh's "dp" dimension; 2 replicas x 2 stages on 4 CPU
ranks, gloo): a lost stage rank is restored from the same stage of the other replica, and with
both replicas of a stage lost the job falls back to the checkpoint. Either way every rank ends
bitwise equal to its own rank's in a fault-free run of the same schedule (ranks of different
stages hold different layers)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from livejob import EXAMPLES, JobResult, Processes, run_job
from test_live_recovery import assert_survivors_kept

from flashrecovery.records import Envelope
from flashrecovery.replay.replayer import replay_job

pytestmark = pytest.mark.timeout(300)

PP = {"script": EXAMPLES / "train_pp.py", "nproc": 4, "shards": 2}
WORLD = 4


References = dict[str, dict[int, torch.Tensor]]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    """Each schedule's fault-free run, made once when first asked for."""
    return {}


def reference(references: References, tmp_path: Path, schedule: str) -> dict[int, torch.Tensor]:
    if schedule not in references:
        job = run_pp(tmp_path / "reference", schedule)
        assert job.exit_code == 0
        references[schedule] = {rank: job.final(rank)["params"] for rank in range(WORLD)}
    return references[schedule]


def run_pp(tmp_path: Path, schedule: str, **kwargs: Any) -> JobResult:
    args = ["--schedule", schedule]
    return run_job(tmp_path, **PP, script_args=args, **kwargs)  # type: ignore[arg-type]


def assert_each_rank_equal(job: JobResult, reference: dict[int, torch.Tensor]) -> None:
    assert job.exit_code == 0, job.records(type="job_finished")
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], reference[rank]), f"rank {rank} diverged"
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_rank_is_restored_from_the_same_stage_of_the_other_replica(
    tmp_path: Path, references: References, schedule: str
) -> None:
    job = run_pp(tmp_path / "job", schedule, spares=1, kill_at={1: 8})
    assert_each_rank_equal(job, reference(references, tmp_path, schedule))
    assert_survivors_kept(job, failed={1}, world=WORLD)
    [closed] = job.decisions("incident_closed")
    assert closed.rpo_steps == 0 and closed.recomputed_steps <= 1
    [plan] = job.decisions("resume_planned")
    assert (plan.donors, plan.recipients) == ({0: 0, 1: 3}, [1])  # rank 3 runs stage 1 too
    [moved] = job.records(type="state_transferred")
    assert (moved.rank, moved.donor) == (1, 3)


def test_both_replicas_of_a_stage_lost_fall_back_to_the_checkpoint(
    tmp_path: Path, references: References
) -> None:
    killed: dict[int, int] = {}

    def kill_stage_1(record: Envelope, known: Processes) -> bool:
        if record.type != "step_completed" or record.rank != 1 or record.step < 9:  # type: ignore[attr-defined]
            return False
        for rank in (1, 3):
            killed[rank] = known.ranks[rank]
            os.kill(known.ranks[rank], signal.SIGKILL)
        return True

    job = run_pp(tmp_path / "job", "gpipe", spares=2, checkpoint_every=4, scenario=[kill_stage_1])
    assert sorted(killed) == [1, 3]
    assert_each_rank_equal(job, reference(references, tmp_path, "gpipe"))
    assert_survivors_kept(job, failed={1, 3}, world=WORLD)
    [fallback] = job.decisions("fallback_to_checkpoint")
    assert fallback.shards == [1] and fallback.step == 7
    loaded = job.records(type="checkpoint_loaded")
    assert sorted(r.rank for r in loaded if r.generation == fallback.generation) == [0, 1, 2, 3]
