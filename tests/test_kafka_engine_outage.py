"""Broker stopped mid-run and restarted while the engine runs: no acknowledged record lost, none
duplicated, and the engine carries on deciding."""

from __future__ import annotations

import time

import pytest
from kafka_fixture import fresh_prefix

from flashrecovery.connectors import open_log
from flashrecovery.connectors.kafka_broker import KafkaBroker
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import LogError
from flashrecovery.records import Decision, Envelope, Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.testing.simworld import SimulatedWorld

pytestmark = pytest.mark.kafka
JOB = "outage"


def test_engine_rides_out_a_broker_restart(own_broker: KafkaBroker) -> None:
    url = f"kafka://{own_broker.bootstrap}?topic_prefix={fresh_prefix()}&timeout_s=3"
    log = open_log(url)
    world = SimulatedWorld(
        JOB, world_size=2, spares=1, heartbeat_interval_s=600.0, clock=time.time()
    )
    engine = EngineLoop(url, JOB, poll_s=0.2).start()
    acknowledged: list[Envelope] = []

    def append(records: list[Envelope]) -> None:
        """As the agent does: retry a refused append (a refusal is final: nothing was stored)."""
        deadline = time.monotonic() + 60
        for record in records:
            while True:
                try:
                    log.append(Stream.EVENTS, record)
                    break
                except LogError:
                    assert time.monotonic() < deadline, "the broker did not come back"
            acknowledged.append(record)

    def decisions() -> list[Decision]:
        return [e.record for e in log.read(Stream.DECISIONS, JOB) if isinstance(e.record, Decision)]

    def decisions_once_reachable() -> list[Decision]:
        try:
            log.follow(Stream.DECISIONS, JOB, 0, timeout=1.0)
            return decisions()
        except LogError:  # the client is still reconnecting
            return []

    try:
        append([*world.start(), *world.train(2)])
        own_broker.stop(keep_data=True)
        with pytest.raises(LogError):
            log.append(Stream.EVENTS, world.kill(1))  # refused, never acknowledged
        own_broker.start()

        append([world.kill(1)])
        deadline = time.monotonic() + 60
        while len(decisions_once_reachable()) < 3:  # the engine, still running, decides
            assert engine.error is None, engine.error
            assert time.monotonic() < deadline, "the engine did not decide after the restart"
        assert [d.type for d in decisions()] == ["isolate_rank", "assign_spare", "regroup_planned"]
    finally:
        engine.stop()

    stored = [e.record for e in log.read(Stream.EVENTS, JOB)]
    assert stored == acknowledged  # every acknowledged record, once, in order; not the refused one
    ids = [d.record_id for d in decisions()]
    assert len(ids) == len(set(ids))
    assert replay_job(log, JOB).ok
    log.close()
