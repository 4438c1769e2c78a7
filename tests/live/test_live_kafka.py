"""The whole product on Kafka: a real job loses a rank, recovers, and its log — on the broker —
replays with no divergence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from livejob import run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def test_kill_and_recover_with_the_log_on_kafka(
    tmp_path: Path, reference: torch.Tensor, kafka_log_url: str
) -> None:
    job = run_job(tmp_path, spares=1, kill_at={1: 8}, log_url=kafka_log_url)
    assert job.log.url == kafka_log_url
    assert_lossless(job, reference, incidents=1)  # replays from the broker's first offset
    assert_survivors_kept(job, failed={1})
