"""Engine failover through Kafka: two `flashrecovery engine` processes serve one job; SIGKILL the
active one mid-incident and the standby finishes the incident with no decision written twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from factories import engine_env, signed

from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import LogConnector
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.records import Decision, EngineLease, Envelope, Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.testing.simworld import SimulatedWorld, scripted_failure

pytestmark = pytest.mark.kafka
JOB = "failover"
WAIT_S = 60.0


def wait_for(what: str, condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Poll a condition that depends on other processes, with a bound and a clear failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def decisions(log: LogConnector) -> list[Decision]:
    return [e.record for e in log.read(Stream.DECISIONS, JOB) if isinstance(e.record, Decision)]


def lease_holder(log: LogConnector) -> str | None:
    book = LeaseBook()
    for entry in log.read(Stream.EVENTS, JOB):
        if isinstance(entry.record, EngineLease):
            book.observe(entry.record)
    return book.holder(time.time())


@pytest.fixture
def engines(kafka_log_url: str) -> Iterator[dict[str, subprocess.Popen[str]]]:
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flashrecovery.cli",
                "engine",
                "--log",
                kafka_log_url,
                "--job",
                JOB,
                "--lease-ttl",
                "1.5",
                "--engine-id",
                name,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=engine_env(),
        )
        for name in ("a", "b")
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def test_standby_engine_takes_over_mid_incident(
    kafka_log_url: str, engines: dict[str, subprocess.Popen[str]]
) -> None:
    reference = [d.type for d in scripted_failure(MemoryLog(), JOB)]
    log = signed(open_log(kafka_log_url))
    # Heartbeats far apart: the seconds a takeover takes must not look like a silent rank.
    world = SimulatedWorld(JOB, heartbeat_interval_s=60.0, clock=time.time())

    def append(records: list[Envelope]) -> None:
        for record in records:
            log.append(Stream.EVENTS, record)

    try:
        append([*world.start(), *world.train(3)])
        wait_for("an engine to hold the lease", lambda: lease_holder(log) is not None)
        active = lease_holder(log)
        assert active in engines
        standby = next(name for name in engines if name != active)

        append([world.kill(2)])
        wait_for("isolate, assign and regroup", lambda: len(decisions(log)) >= 3)
        engines[active].send_signal(signal.SIGKILL)
        engines[active].wait(timeout=30)
        first = decisions(log)
        assert [d.type for d in first] == reference[:3]

        append([r for d in first for r in world.react(d)])
        wait_for("the standby to plan the resume", lambda: len(decisions(log)) >= 4)
        assert lease_holder(log) == standby
        resume = decisions(log)[3:]
        append([r for d in resume for r in world.react(d)])
        append([*world.train(2), *world.finish()])
        assert engines[standby].wait(timeout=WAIT_S) == 0  # it stops once the job completed

        written = decisions(log)
        assert [d.type for d in written] == reference
        ids = [d.record_id for d in written]
        assert len(ids) == len(set(ids)), "a decision was written twice"
        report = replay_job(log, JOB)
        assert report.ok, report.divergence
        assert report.state.job.state == "completed"
    finally:
        log.close()
    assert engines[active].returncode == -signal.SIGKILL
