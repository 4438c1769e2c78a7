"""Faults of the control plane in the middle of an incident, on Kafka: the deciding engine
SIGKILLed, the broker restarted. The job still ends bitwise equal to a fault-free run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from kafka_fixture import fresh_prefix
from livejob import Processes, engine_services, run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

from flashrecovery.connectors.kafka_broker import KafkaBroker
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.records import EngineLease, Envelope, RankExited, Stream

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def test_engine_killed_mid_incident_the_standby_finishes_it(
    tmp_path: Path, reference: torch.Tensor, kafka_log_url: str
) -> None:
    """No spare: the fresh replacement takes seconds to start, so the incident is open when
    the lease holder is SIGKILLed right after the rank's exit is in the log; the standby must
    plan the resume and close the incident."""
    leases = LeaseBook()
    killed: dict[str, float] = {}  # engine -> when

    def kill_the_holder_once_rank_1_exits(record: Envelope, known: Processes) -> bool:
        if isinstance(record, EngineLease):
            leases.observe(record)
        if not (isinstance(record, RankExited) and record.rank == 1):
            return False
        holder = leases.holder(time.time())
        assert holder is not None, "no engine held the lease"
        engines[holder].kill()
        killed[holder] = time.time()
        return True

    with engine_services(kafka_log_url, tmp_path) as engines:
        job = run_job(
            tmp_path,
            spares=0,
            kill_at={1: 8},
            log_url=kafka_log_url,
            external_engine=True,
            scenario=[kill_the_holder_once_rank_1_exits],
        )
        [(dead, killed_at)] = killed.items()
        standby = next(name for name in engines if name != dead)
        assert engines[standby].wait(timeout=60) == 0  # it served the job to its end
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    [resume] = job.decisions("resume_planned")
    [closed] = job.decisions("incident_closed")
    assert killed_at < resume.ts < closed.ts  # the incident was open; the standby finished it
    ids = [d.record_id for d in job.records(Stream.DECISIONS)]
    assert len(ids) == len(set(ids)), "a decision was written twice"


def test_broker_restarted_mid_incident(
    tmp_path: Path, reference: torch.Tensor, own_broker: KafkaBroker
) -> None:
    """The broker goes down right after a rank's exit is in the log and comes back on the same
    data: ranks, agent and engine ride the outage out (records are retried, not lost, and
    silence while the log was away is not taken for death)."""
    url = f"kafka://{own_broker.bootstrap}?topic_prefix={fresh_prefix()}&timeout_s=30"
    outage: dict[str, float] = {}

    def restart_once_rank_1_exits(record: Envelope, known: Processes) -> bool:
        """In this (the main) thread: the broker dies with the thread that started it."""
        if not (isinstance(record, RankExited) and record.rank == 1):
            return False
        outage["down"] = time.time()
        own_broker.stop(keep_data=True)
        own_broker.start()
        outage["up"] = time.time()
        return True

    job = run_job(
        tmp_path, spares=1, kill_at={1: 8}, log_url=url, scenario=[restart_once_rank_1_exits]
    )
    assert "up" in outage, "the broker was not restarted"
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    assert job.records(type="heartbeat_missed") == []
    [closed] = job.decisions("incident_closed")
    assert closed.ts > outage["down"]  # the incident was still open when the broker went down
    ids = [r.record_id for r in job.records()]
    assert len(ids) == len(set(ids)), "a record was stored twice"
