"""Live checkpoint fallback (FSDP2 on CPU ranks, gloo, real SIGKILL): when no replica of a
shard is left, every member loads the latest complete asynchronous checkpoint and the job
carries on to a result bitwise equal to a fault-free run; survivors keep their processes and
replay reports the committed steps rolled back (RPO)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from livejob import EXAMPLES, JobResult, Processes, Scenario, run_job
from test_live_recovery import assert_survivors_kept

from flashrecovery.records import Envelope
from flashrecovery.replay.replayer import replay_job
from flashrecovery.trainer_hooks.checkpoint import MARKER

pytestmark = pytest.mark.timeout(300)

HSDP = {"script": EXAMPLES / "train_hsdp.py", "nproc": 4, "shards": 2}  # 2 replicas x 2 shards
FSDP = {"script": EXAMPLES / "train_hsdp.py", "nproc": 2, "shards": 2}  # no replica
FSDP_ARGS = ["--replicas", "1", "--epochs", "2"]  # 20 steps an epoch
HSDP_ARGS = ["--epochs", "2"]  # 10 steps an epoch


def reference(tmp_path: Path, job: dict[str, Any], args: list[str]) -> torch.Tensor:
    run = run_job(tmp_path, **job, script_args=args)
    assert run.exit_code == 0
    params: torch.Tensor = run.final(0)["params"]
    return params


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return reference(tmp_path_factory.mktemp("hsdp-reference"), HSDP, HSDP_ARGS)


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return reference(tmp_path_factory.mktemp("fsdp-reference"), FSDP, FSDP_ARGS)


def kill_together(ranks: list[int], after: int, killed: dict[int, int]) -> Scenario:
    """SIGKILL every rank in ``ranks`` at once when the first has committed step ``after``."""

    def step(record: Envelope, known: Processes) -> bool:
        if record.type != "step_completed" or record.rank != ranks[0] or record.step < after:  # type: ignore[attr-defined]
            return False
        for rank in ranks:
            killed[rank] = known.ranks[rank]
            os.kill(known.ranks[rank], signal.SIGKILL)
        return True

    return step


def assert_fell_back(job: JobResult, params: torch.Tensor, world: int) -> int:
    """The job completed bitwise equal to the reference after one checkpoint fallback, every
    member loaded the checkpoint, and replay agrees on the steps rolled back; returns them."""
    assert job.exit_code == 0, job.records(type="job_finished")
    for rank in range(world):
        assert torch.equal(job.final(rank)["params"], params), f"rank {rank} diverged"
    [fallback] = job.decisions("fallback_to_checkpoint")
    saved = [r.step for r in job.records(type="checkpoint_saved") if r.step <= fallback.step]
    assert fallback.step is not None and fallback.step == max(saved)
    assert (Path(fallback.path) / MARKER).is_file()
    loaded = job.records(type="checkpoint_loaded")
    assert sorted(r.rank for r in loaded if r.generation == fallback.generation) == list(
        range(world)
    )
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()
    closed = {c.incident_id: c for c in job.decisions("incident_closed")}
    assert closed and len(closed) == len(report.incidents())
    for incident in report.incidents():
        assert incident["checkpoint_step"] == fallback.step
        assert incident["rpo_steps"] == closed[incident["incident_id"]].rpo_steps
    rpo: int = max(i["rpo_steps"] for i in report.incidents())
    assert rpo >= 1  # committed steps after the checkpoint were lost and recomputed
    return rpo


def test_hsdp_both_replicas_of_a_shard_lost_falls_back_to_the_checkpoint(
    tmp_path: Path, hsdp_reference: torch.Tensor
) -> None:
    killed: dict[int, int] = {}
    job = run_job(
        tmp_path,
        **HSDP,  # type: ignore[arg-type]
        spares=2,
        checkpoint_every=4,
        script_args=HSDP_ARGS,
        scenario=[kill_together([1, 3], 13, killed)],
    )
    assert sorted(killed) == [1, 3]
    assert_fell_back(job, hsdp_reference, world=4)
    assert_survivors_kept(job, failed={1, 3}, world=4)
    assert {d.shards[0] for d in job.decisions("fallback_to_checkpoint")} == {1}


def test_pure_fsdp_rank_lost_falls_back_across_an_epoch(
    tmp_path: Path, fsdp_reference: torch.Tensor
) -> None:
    job = run_job(
        tmp_path,
        **FSDP,  # type: ignore[arg-type]
        spares=1,
        checkpoint_every=8,
        script_args=FSDP_ARGS,
        kill_at={1: 20},  # in epoch 1; the checkpoints are of steps 7 and 15 (epoch 0)
    )
    rpo = assert_fell_back(job, fsdp_reference, world=2)
    assert rpo >= 20 - 15
    assert_survivors_kept(job, failed={1}, world=2)


def test_a_member_lost_while_loading_the_checkpoint_falls_back_again(
    tmp_path: Path, fsdp_reference: torch.Tensor
) -> None:
    """Pure FSDP: rank 1 is SIGKILLed in epoch 1 and the job falls back to step 15's
    checkpoint; rank 0 dies as it starts loading it. The engine falls back once more, both
    ranks are taken over by spares, and the job still ends bitwise equal to a fault-free run."""
    job = run_job(
        tmp_path,
        **FSDP,  # type: ignore[arg-type]
        spares=2,
        checkpoint_every=8,
        script_args=FSDP_ARGS,
        kill_at={1: 20},
        fault_plan=["0:checkpoint_load@15"],
    )
    assert job.exit_code == 0, job.records(type="job_finished")
    for rank in range(2):
        assert torch.equal(job.final(rank)["params"], fsdp_reference), f"rank {rank} diverged"
    fallbacks = job.decisions("fallback_to_checkpoint")
    assert len(fallbacks) == 2 and {f.step for f in fallbacks} == {15}
    loaded = job.records(type="checkpoint_loaded")
    assert sorted(r.rank for r in loaded if r.generation == fallbacks[-1].generation) == [0, 1]
    assert [i.failed_rank for i in job.decisions("incident_closed")] == [1, 0]
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()
    assert_survivors_kept(job, failed={0, 1}, world=2)
