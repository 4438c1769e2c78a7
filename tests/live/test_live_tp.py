"""Live recovery of tensor parallel beside FSDP2 (examples/train_tp.py: ``parallelize_module``
over the mesh's "tp" dimension, ``fully_shard`` over ("dp_replicate", "dp_shard"); 2 replicas x
1 x 2 tp on 4 CPU ranks, gloo): a lost rank is restored from the rank at its (dp_shard, tp)
coordinate in the other replica, the replacement's optimizer state rebuilt on the parts of the
mesh it lies on; with that donor lost mid-transfer no replica of the coordinate is left and the
job falls back to the checkpoint. Either way it ends bitwise equal to a fault-free run. The
same with sequence parallel; tensor parallel alone (2 tp ranks, one replica, no FSDP2) falls
back to the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from livejob import EXAMPLES, run_job
from test_live_checkpoint import assert_fell_back
from test_live_hsdp import assert_restored_from
from test_live_recovery import assert_survivors_kept

pytestmark = pytest.mark.timeout(300)

TP_HSDP = {"script": EXAMPLES / "train_tp.py", "nproc": 4, "shards": 2}
ARGS = ["--epochs", "1"]  # 20 steps


@pytest.fixture(scope="module")
def tp_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    job = run_job(tmp_path_factory.mktemp("tp-reference"), **TP_HSDP, script_args=ARGS)  # type: ignore[arg-type]
    assert job.exit_code == 0
    params: torch.Tensor = job.final(0)["params"]
    return params


def run_tp(tmp_path: Path, **kwargs: Any) -> Any:
    return run_job(tmp_path, **TP_HSDP, script_args=ARGS, **kwargs)  # type: ignore[arg-type]


def test_a_tp_rank_is_restored_from_its_coordinate_in_the_other_replica(
    tmp_path: Path, tp_reference: torch.Tensor
) -> None:
    job = run_tp(tmp_path, spares=1, kill_at={1: 8})
    assert_restored_from(job, tp_reference, 1, 3, {0: 0, 1: 3})  # rank 3: tp 1 of replica 1


def test_with_sequence_parallel_a_rank_is_restored_from_its_coordinate(tmp_path: Path) -> None:
    """The norm and the head on parts of the sequence (``SequenceParallel``: their parameters
    replicated DTensors on "tp"), the feed-forward gathering and scattering them."""
    args = [*ARGS, "--sequence-parallel"]
    reference = run_job(tmp_path / "reference", **TP_HSDP, script_args=args)  # type: ignore[arg-type]
    assert reference.exit_code == 0
    job = run_job(tmp_path / "job", **TP_HSDP, script_args=args, spares=1, kill_at={1: 8})  # type: ignore[arg-type]
    assert_restored_from(job, reference.final(0)["params"], 1, 3, {0: 0, 1: 3})


def test_a_tp_coordinates_last_replica_lost_mid_transfer_falls_back_to_the_checkpoint(
    tmp_path: Path, tp_reference: torch.Tensor
) -> None:
    """Rank 1 dies at step 10; rank 3, the only other holder of its coordinate, dies as it
    sends: every member loads the latest checkpoint, of step 7 (the TP DTensors' shards too),
    and computes steps 8 and 9 again."""
    job = run_tp(
        tmp_path,
        spares=2,
        checkpoint_every=4,
        fault_plan=["1:before_reduce@10", "3:donor_send@9"],
    )
    assert assert_fell_back(job, tp_reference, world=4) == 2  # steps 8 and 9 again
    assert_survivors_kept(job, failed={1, 3}, world=4)
    assert {d.shards[0] for d in job.decisions("fallback_to_checkpoint")} == {1}


def test_tensor_parallel_alone_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    """One replica of 2 tp ranks, no FSDP2 (``--replicas 1 --dp-shard 1``): rank 1 killed at
    step 9 leaves no other holder of its tp shard, so both ranks load the checkpoint of step 7
    and compute steps 8 and 9 again."""
    alone = {
        "script": EXAMPLES / "train_tp.py",
        "nproc": 2,
        "shards": 2,
        "script_args": [*ARGS, "--replicas", "1", "--dp-shard", "1"],
    }
    reference = run_job(tmp_path / "reference", **alone)  # type: ignore[arg-type]
    assert reference.exit_code == 0
    job = run_job(tmp_path / "job", **alone, spares=1, checkpoint_every=4, kill_at={1: 9})  # type: ignore[arg-type]
    assert assert_fell_back(job, reference.final(0)["params"], world=2) == 2
    assert_survivors_kept(job, failed={1}, world=2)
