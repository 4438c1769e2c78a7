"""Event-log backends behind one interface, chosen by URL.

``memory://`` (tests), ``sqlite:///path/run.db`` (embedded, the default), ``kafka://host:port``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.errors import LogError

__all__ = ["Entry", "LogConnector", "open_log"]

SCHEMES = ("memory", "sqlite", "kafka")


def open_log(url: str, *, read_only: bool = False) -> LogConnector:
    """Open the log a URL names; an unknown or malformed URL is a LogError that says why.
    ``read_only``: for tools that only read (events, replay), which must create nothing: a
    missing log is an error (a mistyped path leaves no empty database, a mistyped topic prefix
    no topics behind)."""
    if not isinstance(url, str) or "://" not in url:
        raise LogError(
            f"log URL {url!r} is malformed: expected scheme://…, one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from flashrecovery.connectors.memory import MemoryLog

        return MemoryLog(url)
    if scheme == "sqlite":
        from flashrecovery.connectors.embedded import EmbeddedLog

        return EmbeddedLog.from_url(url, read_only=read_only)
    if scheme == "kafka":
        from flashrecovery.connectors.kafka import KafkaLog

        return KafkaLog.from_url(url, read_only=read_only)
    raise LogError(
        f"log URL {url!r} has unknown scheme {scheme!r}: use one of "
        + ", ".join(f"{s}://" for s in SCHEMES)
    )
