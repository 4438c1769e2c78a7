"""The whole product on Kafka: a real job loses a rank, recovers, and its log — on the broker —
replays with no divergence."""

from __future__ import annotations

import json
import subprocess
import sys
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


def test_events_and_replay_commands_read_the_job_from_kafka(
    tmp_path: Path, kafka_log_url: str
) -> None:
    job = run_job(tmp_path, spares=0, kill_at={2: 5}, log_url=kafka_log_url)
    assert job.exit_code == 0

    def cli(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "flashrecovery.cli", *argv, "--log", kafka_log_url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    rows = [json.loads(line) for line in cli("events", "--job", job.job_id, "--json").splitlines()]
    types = [row["type"] for row in rows]
    assert (
        types.index("rank_exited")
        < types.index("spawn_replacement")
        < types.index("incident_closed")
    )
    report = json.loads(cli("replay", "--job", job.job_id, "--json"))
    assert report["ok"] and report["job_state"] == "completed"
    [incident] = report["incidents"]
    assert incident["failed_rank"] == 2 and incident["rpo_steps"] == 0
