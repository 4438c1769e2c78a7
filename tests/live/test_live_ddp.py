"""Live recovery of a model wrapped once in torch DDP over the session's stable process group:
a rank is SIGKILLed, the survivors keep their processes and their DDP wrapper, the group is
rebuilt underneath it, and the job ends bitwise equal to a fault-free DDP run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from livejob import EXAMPLES, STEPS, Processes, run_job
from test_live_exposure import listening
from test_live_recovery import assert_lossless, assert_survivors_kept

from flashrecovery.records import Envelope, StepCompleted

pytestmark = pytest.mark.timeout(240)

DDP = ["--parallel", "ddp"]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    job = run_job(tmp_path_factory.mktemp("ddp-reference"), script_args=DDP)
    assert job.exit_code == 0
    assert job.records(type="collective_error") == []
    params: torch.Tensor = job.final(0)["params"]
    return params


def test_ddp_kill_with_hot_spare(tmp_path: Path, ddp_reference: torch.Tensor) -> None:
    """Also: while nothing failed, each rank has one gloo device, DDP's (its one listening
    socket): the hook builds its own group only where a restore needs it."""
    sockets: dict[int, int] = {}

    def count_gloo_devices(record: Envelope, known: Processes) -> bool:
        if isinstance(record, StepCompleted) and record.step == 1:
            sockets[record.rank] = len(listening(known.ranks[record.rank]))
        return len(sockets) == len(known.ranks) > 0

    job = run_job(
        tmp_path, spares=1, kill_at={1: 8}, script_args=DDP, scenario=[count_gloo_devices]
    )
    assert sockets == {0: 1, 1: 1, 2: 1}
    assert_lossless(job, ddp_reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    activated = job.records(type="spare_activated")
    assert [(a.rank, a.spare_id) for a in activated] == [(1, 0)]
    assert job.final(1)["pid"] == activated[0].pid
    # The survivors learnt of the loss inside DDP's all-reduce, not from an exception.
    assert {e.rank for e in job.records(type="collective_error")} <= {0, 2}


def test_ddp_kill_with_hot_spare_on_a_reconfigured_group(
    tmp_path: Path, ddp_reference: torch.Tensor
) -> None:
    """``--group-rebuild reconfigure``: the DDP group's one backend is reconfigured in place to
    take the spare (gloo here; on CUDA the NCCL communicator shrinks and grows)."""
    job = run_job(tmp_path, spares=1, kill_at={1: 8}, script_args=DDP, group_rebuild="reconfigure")
    assert_lossless(job, ddp_reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    activated = job.records(type="spare_activated")
    assert job.final(1)["pid"] == activated[0].pid


def test_second_rank_lost_while_a_reconfigured_group_regroups(
    tmp_path: Path, ddp_reference: torch.Tensor
) -> None:
    """Rank 2 dies as generation 1 forms: the survivors' reconfigure waits for its handle only
    until generation 2 is planned, which reconfigures from new backends."""
    job = run_job(
        tmp_path,
        spares=2,
        fault_plan=["1:before_reduce@8", "2:regroup@7"],
        script_args=DDP,
        group_rebuild="reconfigure",
    )
    assert_lossless(job, ddp_reference, incidents=2)
    assert_survivors_kept(job, failed={1, 2})


def test_ddp_kill_without_spare(tmp_path: Path, ddp_reference: torch.Tensor) -> None:
    job = run_job(tmp_path, spares=0, kill_at={2: 8}, script_args=DDP)
    assert_lossless(job, ddp_reference, incidents=1)
    assert_survivors_kept(job, failed={2})
    spawned = job.records(type="replacement_spawned")
    assert [s.rank for s in spawned] == [2]
    assert job.final(2)["pid"] == spawned[0].pid


def test_ddp_kill_between_reduce_and_vote(tmp_path: Path, ddp_reference: torch.Tensor) -> None:
    """DDP's all-reduce succeeded everywhere, then a rank dies before its vote: the step
    must not commit for anyone (the survivors' optimizers never step on it)."""
    job = run_job(tmp_path, spares=1, fault_plan=["0:after_reduce@8"], script_args=DDP)
    assert_lossless(job, ddp_reference, incidents=1)
    assert_survivors_kept(job, failed={0})
    committed = {r.step for r in job.records(type="step_completed") if r.generation == 0}
    assert max(committed) == 7


# examples/train_ddp.py: an ordinary DDP loop over a DataLoader with a DistributedSampler, 3
# epochs of 10 batches per rank (STEPS steps in all).
EXAMPLE = EXAMPLES / "train_ddp.py"


@pytest.fixture(scope="module")
def loader_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    job = run_job(tmp_path_factory.mktemp("loader-reference"), script=EXAMPLE)
    assert job.exit_code == 0
    params: torch.Tensor = job.final(0)["params"]
    return params


@pytest.mark.parametrize(("spares", "kill_step"), [(1, 12), (0, 19)])
def test_ddp_example_resumes_its_data_position(
    tmp_path: Path, loader_reference: torch.Tensor, spares: int, kill_step: int
) -> None:
    """Killed mid-epoch (epoch 1, batch 2; epoch 1, batch 9: the last of the epoch), the
    replacement resumes the donor's epoch at its next batch and skips the ones committed."""
    job = run_job(tmp_path, spares=spares, kill_at={1: kill_step}, script=EXAMPLE)
    assert_lossless(job, loader_reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    steps = sorted({r.step for r in job.records(type="step_completed")})
    assert steps == list(range(STEPS))


# examples/train_ddp_stateful.py: the same job with torchdata's StatefulDataLoader, its own
# `for x, y in loader` loop kept (the loader given to session.register).
STATEFUL = EXAMPLES / "train_ddp_stateful.py"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_in_its_own_loop_resumes_from_its_state(
    tmp_path: Path, loader_reference: torch.Tensor, workers: int
) -> None:
    """Killed mid-epoch, the replacement loads its donor's loader state and reads on from
    the next batch: no sample read twice (with workers, the workers read), and every rank
    ends bitwise equal to the plain DataLoader's fault-free run (the global random state the
    loader's iter() draws from restored with the rest)."""
    job = run_job(
        tmp_path,
        spares=1,
        kill_at={1: 12},
        script=STATEFUL,
        script_args=["--workers", str(workers)],
    )
    assert_lossless(job, loader_reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    steps = sorted({r.step for r in job.records(type="step_completed")})
    assert steps == list(range(STEPS))
    replacement = job.final(1)
    trained = {  # the steps the replacement computed (the generations after the kill)
        r.step for r in job.records(type="step_completed") if r.rank == 1 and r.generation > 0
    }
    assert min(trained) in (13, 14) and max(trained) == STEPS - 1
    assert replacement["read"] == (len(trained) * 8 if workers == 0 else 0)


def test_a_peer_lost_in_the_scripts_collectives_after_training_fails_the_job_in_one_line(
    tmp_path: Path,
) -> None:
    """The script runs all-reduces of its own after its training loop (as a save of its own
    would); rank 2 is SIGKILLed there. Recovery covers training steps only: the survivors'
    collective raises instead of returning its input untouched, and the job fails naming why,
    rather than ending 0 with whatever those collectives computed."""
    job = run_job(tmp_path, spares=1, kill_at={2: STEPS - 1}, script_args=[*DDP, "--after", "60"])
    assert job.exit_code != 0
    [failed] = job.decisions("fail_job")
    assert "LostAfterTraining: a peer was lost after the job's last committed step" in (
        failed.last_error
    )
    [finished] = job.records(type="job_finished")
    assert finished.status == "failed"
