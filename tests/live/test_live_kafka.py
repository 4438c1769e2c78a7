"""The whole product on Kafka: a real job loses a rank, recovers, and its log — on the broker —
replays with no divergence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from livejob import engine_services, run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

from flashrecovery.connectors import open_log
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.records import EngineLease, RankJoined, StepCompleted, Stream

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


def test_engine_failover_while_a_live_job_recovers(
    tmp_path: Path, reference: torch.Tensor, kafka_log_url: str
) -> None:
    """Two `flashrecovery engine` services share the job; the lease holder is SIGKILLed while
    the job trains, then a rank is SIGKILLed, and the standby handles that incident."""
    dead_engine: dict[str, float] = {}  # name -> the step at which it was killed
    kill_times: dict[str, float] = {}  # "engine" / "rank" -> when

    def kill_the_lease_holder_then_rank_1() -> None:
        with open_log(kafka_log_url) as log:
            deadline, position = time.monotonic() + 120, 0
            leases, joined, step = LeaseBook(), {}, -1
            while time.monotonic() < deadline and "rank" not in kill_times:
                for entry in log.follow(Stream.EVENTS, "live", position, timeout=0.5):
                    position, record = entry.position + 1, entry.record
                    if isinstance(record, EngineLease):
                        leases.observe(record)
                    elif isinstance(record, RankJoined):
                        joined[record.rank] = record.pid
                    elif isinstance(record, StepCompleted):
                        step = max(step, record.step)
                holder = leases.holder(time.time())
                if not dead_engine and holder and step >= 3:
                    engines[holder].kill()
                    dead_engine[holder], kill_times["engine"] = step, time.time()
                elif dead_engine and step >= max(dead_engine.values()) + 2:
                    os.kill(joined[1], signal.SIGKILL)
                    kill_times["rank"] = time.time()

    killer = threading.Thread(target=kill_the_lease_holder_then_rank_1, daemon=True)
    with engine_services(kafka_log_url, tmp_path) as engines:
        killer.start()
        job = run_job(
            tmp_path, spares=1, log_url=kafka_log_url, external_engine=True, step_time_s=0.1
        )
        killer.join(30)
        [dead] = dead_engine
        standby = next(name for name in engines if name != dead)
        assert engines[standby].wait(timeout=60) == 0  # it served the job to its end
    assert kill_times["engine"] < kill_times["rank"]  # the incident came after the holder died
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    ids = [d.record_id for d in job.records(Stream.DECISIONS)]
    assert len(ids) == len(set(ids)), "a decision was written twice"
