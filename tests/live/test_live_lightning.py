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
