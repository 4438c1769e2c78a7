"""The real Kafka broker for the test session: started once, stopped at the end even on failure.

``kafka_bootstrap`` gives its ``127.0.0.1:PORT``; ``kafka_log_url`` is a URL naming a fresh,
empty log on it (a unique topic prefix). When ``FLASHRECOVERY_TEST_BROKER`` is set (CI starts
the broker with ``flashrecovery broker start`` first), the tests use that broker instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from flashrecovery.connectors.kafka_broker import KafkaBroker


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    broker = KafkaBroker()  # dies with this process too, should pytest be killed
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    external = os.environ.get("FLASHRECOVERY_TEST_BROKER")
    if external:
        return external
    broker: KafkaBroker = request.getfixturevalue("kafka_broker")
    return broker.bootstrap


def kafka_url(bootstrap: str, **params: object) -> str:
    """A URL whose topics no other test uses."""
    query = "&".join(f"{k}={v}" for k, v in {"topic_prefix": fresh_prefix(), **params}.items())
    return f"kafka://{bootstrap}?{query}"


def fresh_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}."


@pytest.fixture
def kafka_log_url(kafka_bootstrap: str) -> str:
    return kafka_url(kafka_bootstrap)
