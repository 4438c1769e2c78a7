"""Shared fixtures. Log backends are listed once here so that one contract suite runs on all.

To add a backend: write a ``(request, tmp_path) -> url`` factory that returns a URL naming a
fresh, empty log (it may pull session fixtures with ``request.getfixturevalue``), register it in
``LOG_URL_FACTORIES`` and append a ``pytest.param`` to ``LOG_BACKENDS`` (and to
``PERSISTENT_LOG_BACKENDS`` if opening the same URL twice reaches the same records).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flashrecovery.connectors import LogConnector, open_log

pytest_plugins = ["kafka_fixture"]  # the session's Kafka broker (kafka_bootstrap)
LogUrlFactory = Callable[[pytest.FixtureRequest, Path], str]


def _memory_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory://"  # every open_log("memory://") is a new, empty store


def _sqlite_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite://{tmp_path / 'log' / 'run.db'}"  # parent dir does not exist yet on purpose


def _kafka_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(request.getfixturevalue("kafka_log_url"))  # on the session's broker


LOG_URL_FACTORIES: dict[str, LogUrlFactory] = {
    "memory": _memory_url,
    "sqlite": _sqlite_url,
    "kafka": _kafka_url,
}
# Backends where a second open_log(url) sees what the first one wrote (reopen, multi-process).
PERSISTENT_LOG_BACKENDS: list[Any] = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("kafka", id="kafka", marks=pytest.mark.kafka),
]
LOG_BACKENDS: list[Any] = [pytest.param("memory", id="memory"), *PERSISTENT_LOG_BACKENDS]


@pytest.fixture(params=LOG_BACKENDS)
def log_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL naming a fresh, empty log, for every backend."""
    return LOG_URL_FACTORIES[request.param](request, tmp_path)


@pytest.fixture(params=PERSISTENT_LOG_BACKENDS)
def persistent_log_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL naming a fresh, empty log that every open_log of it shares."""
    return LOG_URL_FACTORIES[request.param](request, tmp_path)


@pytest.fixture
def log(log_url: str) -> Iterator[LogConnector]:
    """The log behind ``log_url``, closed at teardown."""
    with open_log(log_url) as connector:
        yield connector
