"""The real Kafka broker for the test session: started once, stopped at the end even on failure.

``kafka_bootstrap`` gives its ``127.0.0.1:PORT``; ``kafka_log_url`` is a URL naming a fresh,
empty log on it (a unique topic prefix). When ``FLASHRECOVERY_TEST_BROKER`` is set (CI starts
the broker with ``flashrecovery broker start`` first), the tests use that broker instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashrecovery.connectors.kafka_broker import KafkaBroker, ensure_jars


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
def own_broker() -> Iterator[KafkaBroker]:
    """A broker of the test's own, which it may stop and restart (never the session's)."""
    broker = KafkaBroker()
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def kafka_log_url(kafka_bootstrap: str) -> str:
    return kafka_url(kafka_bootstrap)


# ------------------------------------------------------------- clients the project did not write

CONSOLE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleConsumer"
# The tool's own log lines go to stderr, so stdout holds only the records.
LOG_TO_STDERR = """appender.err.type = Console
appender.err.name = ERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = %p %m%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = ERR
"""
INDEPENDENT_CLIENTS = ["console-consumer", *(["kcat"] if shutil.which("kcat") else [])]


def read_topic(client: str, bootstrap: str, topic: str) -> list[tuple[str, str]]:
    """(key, value) of every record of a topic, as Debian's kcat or the broker's own console
    consumer reads them (committed only, as docs/kafka.md tells users: a fenced engine's
    decisions are an aborted transaction's)."""
    with tempfile.TemporaryDirectory() as tmp:
        if client == "kcat":
            command = ["kcat", "-C", "-b", bootstrap, "-t", topic, "-e", "-q",
                       "-X", "isolation.level=read_committed",
                       "-o", "beginning", "-f", "%k\t%s\n"]  # fmt: skip
        else:
            config = Path(tmp) / "log4j2.properties"
            config.write_text(LOG_TO_STDERR)
            command = ["java", f"-Dlog4j2.configurationFile={config}",
                       "-cp", f"{ensure_jars()}/*", CONSOLE_CONSUMER,
                       "--bootstrap-server", bootstrap, "--topic", topic, "--from-beginning",
                       "--isolation-level", "read_committed",
                       "--timeout-ms", "10000", "--formatter-property", "print.key=true",
                       "--formatter-property", "key.separator=\t"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    return [(key, value) for key, value in (line.split("\t", 1) for line in lines)]
