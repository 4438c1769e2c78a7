"""A Lightning Trainer job under `flashrecovery run` with FlashRecoveryStrategy
(flashrecovery/integrations/lightning.py): examples/train_lightning.py, an ordinary
LightningModule and DataLoader (Lightning adds the DistributedSampler), 3 epochs of 10 batches
per rank on 3 ranks. A rank SIGKILLed mid-epoch is replaced by a hot spare, which receives
Lightning's loop progress with the model and optimizer and reads on from the next batch; every
rank ends bitwise equal to the fault-free run, and the survivors keep their processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from livejob import EXAMPLES, STEPS, run_job

pytestmark = pytest.mark.timeout(300)
EXAMPLE = EXAMPLES / "train_lightning.py"


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    job = run_job(tmp_path_factory.mktemp("lightning-reference"), script=EXAMPLE)
    assert job.exit_code == 0, job.records(type="job_finished")
    assert sorted({r.step for r in job.records(type="step_completed")}) == list(range(STEPS))
    params: torch.Tensor = job.final(0)["params"]
    return params


@pytest.mark.parametrize("kill_step", [12, 19], ids=["mid-epoch", "last-batch-of-an-epoch"])
def test_a_lightning_rank_killed_is_replaced_and_the_job_ends_bitwise_equal(
    tmp_path: Path, lightning_reference: torch.Tensor, kill_step: int
) -> None:
    job = run_job(tmp_path, spares=1, kill_at={1: kill_step}, script=EXAMPLE)
    assert job.exit_code == 0, job.records(type="job_finished")
    assert [r.rank for r in job.records(type="spare_activated")] == [1]
    assert len(job.decisions("incident_closed")) == 1
    steps = sorted({r.step for r in job.records(type="step_completed")})
    assert steps == list(range(STEPS))
    for rank in range(3):
        assert torch.equal(job.final(rank)["params"], lightning_reference), f"rank {rank}"
    first_pids = {r.rank: r.pid for r in job.records(type="rank_joined")}
    for rank in (0, 2):
        assert job.final(rank)["pid"] == first_pids[rank], "a survivor was restarted"
    assert job.final(1)["pid"] != job.killed[1]


# --hsdp: FSDP2 under Lightning (FlashRecoveryHSDPStrategy), 2 replicas x 2 shards on 4 ranks,
# batches of 6 (10 per epoch per rank, as in the DDP job).
HSDP = ["--hsdp", "--batch-size", "6"]


def test_a_lightning_hsdp_rank_killed_is_restored_from_its_shard_s_replica(
    tmp_path: Path,
) -> None:
    (tmp_path / "reference").mkdir()
    reference = run_job(tmp_path / "reference", nproc=4, shards=2, script=EXAMPLE,
                        script_args=HSDP)  # fmt: skip
    assert reference.exit_code == 0, reference.records(type="job_finished")
    (tmp_path / "killed").mkdir()
    job = run_job(tmp_path / "killed", nproc=4, shards=2, spares=1, kill_at={1: 12},
                  script=EXAMPLE, script_args=HSDP)  # fmt: skip
    assert job.exit_code == 0, job.records(type="job_finished")
    assert [r.rank for r in job.records(type="spare_activated")] == [1]
    assert sorted({r.step for r in job.records(type="step_completed")}) == list(range(STEPS))
    [transfer] = job.records(type="state_transferred")
    assert (transfer.rank, transfer.donor) == (1, 3)  # rank 3 holds shard 1 in replica 1
    for rank in range(4):
        assert torch.equal(job.final(rank)["params"], reference.final(0)["params"]), rank
