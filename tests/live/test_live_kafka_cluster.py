"""A job's log on a 3-broker Kafka cluster (replication factor 3, min.insync.replicas 2,
acks=all): the leader of its events partition SIGKILLed in the middle of an incident loses no
record, stores none twice, and the job goes on to end bitwise equal to a fault-free run; a
reader whose leader is paused or killed reads from the next one within its bound."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from factories import JOB, make
from kafka_fixture import kafka_url
from livejob import Processes, run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

from flashrecovery.connectors import open_log
from flashrecovery.connectors.chain import read_streams
from flashrecovery.connectors.kafka import KafkaSettings
from flashrecovery.connectors.kafka_broker import KafkaCluster
from flashrecovery.records import Envelope, Heartbeat, Stream
from flashrecovery.replay.verify import verify

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]


@pytest.fixture
def cluster() -> Iterator[KafkaCluster]:
    brokers = KafkaCluster(3)
    try:
        brokers.start()
        yield brokers
    finally:
        brokers.stop()


def leader_of_events(url: str, job: str) -> int:
    """The broker (node id) leading the partition the job's events are in."""
    settings = KafkaSettings.parse(url)
    admin = settings.connect("admin")
    try:
        [topic] = admin.describe_topics([settings.topic(Stream.EVENTS)])
    finally:
        admin.close()
    [partition] = topic["partitions"]
    assert sorted(partition["replica_nodes"]) == [1, 2, 3]  # on every broker
    assert len(partition["isr_nodes"]) == 3
    leader: int = partition["leader_id"]
    return leader


def test_the_partition_leader_lost_mid_incident_loses_no_record(
    tmp_path: Path, reference: torch.Tensor, cluster: KafkaCluster
) -> None:
    url = kafka_url(cluster.bootstrap)
    killed: list[int] = []

    def kill_the_leader_once_the_spare_takes_over(record: Envelope, known: Processes) -> bool:
        if record.type != "spare_activated":
            return False
        leader = leader_of_events(url, "live")
        broker = cluster.brokers[leader - 1]
        assert broker.process is not None
        broker.process.send_signal(signal.SIGKILL)
        killed.append(leader)
        return True

    job = run_job(
        tmp_path,
        spares=1,
        kill_at={1: 8},
        log_url=url,
        scenario=[kill_the_leader_once_the_spare_takes_over],
    )
    assert killed, "the incident never reached the spare's activation"
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    for stream in Stream:
        ids = [r.record_id for r in job.records(stream)]
        assert len(ids) == len(set(ids)), f"a record of {stream} was stored twice"
    chains = verify(read_streams(job.log, job.job_id))
    assert chains.ok and chains.sealed, chains.first


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["paused", "killed"])
def test_a_reader_whose_leader_is_lost_reads_from_the_next_one(
    cluster: KafkaCluster, fault: signal.Signals
) -> None:
    """A reader's lookup of where the partition ends went to the old leader for as long as its
    client's metadata named it (5 minutes): "Failed to get offsets by timestamps" on each try,
    the engine's and the agents' reads failing after a broker fault (bench.nemesis). Each read
    here is a whole read (lookup, fetch), so retrying it is no sleep."""
    url = kafka_url(cluster.bootstrap)
    writer, reader = open_log(url), open_log(url, read_only=True)
    broker = None
    try:
        writer.append(Stream.EVENTS, make(Heartbeat, record_id="stored", ts=time.time()))
        read = [e.record.record_id for e in reader.read(Stream.EVENTS, JOB)]
        assert read == ["stored"]
        broker = cluster.brokers[leader_of_events(url, JOB) - 1].process
        assert broker is not None
        broker.send_signal(fault)
        # From the leader elected in its place, once that one knows the record committed: a
        # new leader's high watermark can lag its log until its followers fetch from it (up to
        # their fetch wait), and a read ends there, with nothing yet (seen in CI). Never an
        # error, never anything else.
        deadline = time.monotonic() + 30
        while (read := [e.record.record_id for e in reader.read(Stream.EVENTS, JOB)]) == []:
            assert time.monotonic() < deadline, "the new leader never served the record"
        assert read == ["stored"]
    finally:
        if broker is not None and fault is signal.SIGSTOP:
            broker.send_signal(signal.SIGCONT)  # the fixture stops it
        writer.close()
        reader.close()
