"""torchtitan's own Trainer (the torchtitan package, 0.3) under `flashrecovery run -m
flashrecovery.integrations.torchtitan`, its llama3 debug model with torchtitan's configuration
and nothing of it changed but the parallelism flags: 2 replicas x 2 tensor-parallel ranks on 4
CPU ranks (gloo), assets from ``flashrecovery.integrations.torchtitan.assets``. A rank SIGKILLed
mid-training is replaced by a hot spare, restored from the rank at its tp coordinate in the
other replica (through torchtitan's fused qkv, which gathers itself whole when saved), and every
rank ends bitwise equal to the fault-free run; the survivors keep their processes. The first
kill lands in step 0, before anything committed: the donor's optimizers have no state yet, and
reading it must not make any (torchtitan's own state dict would step AdamW once with zero
gradients)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from livejob import run_job

from flashrecovery.agent.config import RunAs
from flashrecovery.integrations.torchtitan import assets

pytestmark = pytest.mark.timeout(300)
STEPS = 8
# Missed after 6 s, not livejob's 3: four ranks building torchtitan's trainer on 2 cores have
# gone 3 s without a beat (a CI run's fault-free reference lost a rank to it in step 0). The
# kills here are found by their exits, not their silence.
HEARTBEAT_S = 2.0


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
        heartbeat_interval_s=HEARTBEAT_S,
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


def test_torchtitan_ranks_killed_are_restored_from_their_tp_coordinate_bitwise_equal(
    tmp_path: Path, titan_args: list[str], titan_reference: str
) -> None:
    """Rank 3 killed in step 0, before anything committed (its donor's optimizers hold no state
    yet); rank 1, at its tp coordinate, in step 4: its donor is rank 3's replacement."""
    plan = ["3:before_reduce@0", "1:before_reduce@4"]
    job = run_titan(tmp_path, titan_args, spares=2, fault_plan=plan)
    assert job.exit_code == 0, job.records(type="job_finished")
    assert [r.rank for r in job.records(type="spare_activated")] == [3, 1]
    plans = [(p.resume_step, p.recipients, p.donors[1]) for p in job.decisions("resume_planned")]
    assert plans == [(-1, [3], 1), (3, [1], 3)]  # its tp coordinate in the other replica
    assert sorted({r.step for r in job.records(type="step_completed")}) == list(range(STEPS))
    first_pids = {r.rank: r.pid for r in job.records(type="rank_joined")}
    for rank in range(4):
        final = job.final_state(rank)
        assert final["params_sha256"] == titan_reference, f"rank {rank} diverged"
        assert (final["pid"] == first_pids[rank]) == (rank in (0, 2)), f"rank {rank}'s process"
