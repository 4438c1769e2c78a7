"""torchtitan's own Trainer (the torchtitan package, 0.3) under `flashrecovery run -m
flashrecovery.integrations.torchtitan`, its llama3 debug model with torchtitan's configuration
and nothing of it changed but the parallelism flags: 2 replicas x 2 tensor-parallel ranks on 4
CPU ranks (gloo), assets from ``flashrecovery.integrations.torchtitan.assets``. A rank SIGKILLed
mid-training is replaced by the hot spare, restored from the rank at its tp coordinate in the
other replica (through torchtitan's fused qkv, which gathers itself whole when saved), and every
rank ends bitwise equal to the fault-free run; the survivors keep their processes. Killed in
step 0 too, before anything committed: the donor's optimizers have no state yet, and reading it
must not make any (torchtitan's own state dict would step AdamW once with zero gradients)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from livejob import run_job

from flashrecovery.agent.config import RunAs
from flashrecovery.integrations.torchtitan import assets

pytestmark = pytest.mark.timeout(300)
STEPS = 8


@pytest.fixture(scope="module")
def titan_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tokenizer, dataset = assets.write(tmp_path_factory.mktemp("titan-assets"))
    return [
        *("--module", "llama3", "--config", "llama3_debugmodel"),
        *("--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(dataset)),
        *("--training.seq_len", "32", "--training.local_batch_size", "2"),
        *("--training.steps", str(STEPS)),
        *("--parallelism.data_parallel_replicate_degree", "2"),
        *("--parallelism.tensor_parallel_degree", "2"),
    ]


def run_titan(tmp_path: Path, titan_args: list[str], **kwargs: Any) -> Any:
    return run_job(
        tmp_path,
        nproc=4,
        shards=2,
        script=Path("flashrecovery.integrations.torchtitan"),
        run_as=RunAs.MODULE,
        harness=False,
        script_args=titan_args,
        **kwargs,
    )


@pytest.fixture(scope="module")
def titan_reference(tmp_path_factory: pytest.TempPathFactory, titan_args: list[str]) -> str:
    job = run_titan(tmp_path_factory.mktemp("titan-reference"), titan_args)
    assert job.exit_code == 0, job.records(type="job_finished")
    assert sorted({r.step for r in job.records(type="step_completed")}) == list(range(STEPS))
    digests = {job.final_state(rank)["params_sha256"] for rank in range(4)}
    assert len(digests) == 1, "the replicas of a fault-free run differ"
    return digests.pop()


@pytest.mark.parametrize(
    "kill",
    [{"kill_at": {3: 2}}, {"fault_plan": ["3:before_reduce@0"]}],
    ids=["after-step-2", "in-step-0"],
)
def test_a_torchtitan_rank_killed_is_restored_from_its_tp_coordinate_bitwise_equal(
    tmp_path: Path, titan_args: list[str], titan_reference: str, kill: dict[str, Any]
) -> None:
    job = run_titan(tmp_path, titan_args, spares=1, **kill)
    assert job.exit_code == 0, job.records(type="job_finished")
    assert [r.rank for r in job.records(type="spare_activated")] == [3]
    (plan,) = job.decisions("resume_planned")
    assert plan.recipients == [3] and plan.donors[1] == 1  # its tp coordinate, other replica
    assert sorted({r.step for r in job.records(type="step_completed")}) == list(range(STEPS))
    first_pids = {r.rank: r.pid for r in job.records(type="rank_joined")}
    for rank in range(4):
        final = job.final_state(rank)
        assert final["params_sha256"] == titan_reference, f"rank {rank} diverged"
        assert (final["pid"] == first_pids[rank]) == (rank != 3), f"rank {rank}'s process"
