"""A cluster on one machine: a job's nodes and a 3-broker Kafka cluster for its log, each host
in a network namespace of its own on one bridge (agent/netns.py). Every link can then fail as
a real network's does: a node (or a broker) cut off, one direction lost, a flapping or a
degraded link. The log must be Kafka here: an embedded log is a file every namespace shares,
which no network fault could touch.

``Testbed(nodes)`` makes the hosts ``n0``…``n<nodes-1>`` and ``b1``…``b3``, starts the brokers
and ends everything on ``close()``, also after a failure.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

from flashrecovery.agent.netns import Network
from flashrecovery.connectors.kafka_broker import KafkaCluster

BROKERS = 3


class Testbed:
    def __init__(self, nodes: int) -> None:
        brokers = [f"b{i}" for i in range(1, BROKERS + 1)]
        self.network = Network([*(f"n{n}" for n in range(nodes)), *brokers])
        try:
            hosts = [(self.network.hosts[b].address, self.network.hosts[b].netns) for b in brokers]
            self.kafka = KafkaCluster(BROKERS, hosts=hosts)
            self.kafka.start()
        except BaseException:
            self.network.close()
            raise

    def log_url(self, topic_prefix: str) -> str:
        return f"kafka://{self.kafka.bootstrap}?topic_prefix={topic_prefix}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kafka.stop()
        self.network.close()

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
