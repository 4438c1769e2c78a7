"""Tailing one stream of one job from a position: the single way every reader follows the log.

The engine loop, the agent, the hook's decisions thread, the demo's watch and `events --follow`
all read through a ``StreamCursor``, so they share one behaviour while the log is unreachable:
return nothing, pause by one ``RetryPolicy`` (doubling, bounded), remember the error, try again.
A reader never crashes on an outage and never spins; it decides itself how long is too long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import structlog

from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.errors import LogError
from flashrecovery.records import Envelope, Stream

log = structlog.get_logger("flashrecovery.log")
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Pauses between attempts while the log is unreachable: ``first_s``, doubling to ``max_s``."""

    first_s: float = 0.1
    max_s: float = 2.0

    def next_delay(self, previous: float) -> float:
        return min(max(previous * 2, self.first_s), self.max_s)


RETRY = RetryPolicy()


class StreamCursor:
    """A position in one (stream, job) that moves past every entry it returns."""

    def __init__(
        self,
        log: LogConnector,
        stream: Stream,
        job_id: str,
        position: int = 0,
        *,
        retry: RetryPolicy = RETRY,
        stop: threading.Event | None = None,
        wake_on_routine: bool = True,
    ) -> None:
        """``wake_on_routine=False``: a poll need not end for routine records (the engine's,
        which acts on nothing in a step's records at once): ``LogConnector.follow``."""
        self.log = log
        self.wake_on_routine = wake_on_routine
        self.stream = stream
        self.job_id = job_id
        self.position = position
        self.retry = retry
        self.last_error: LogError | None = None  # the newest outage, kept for timeout messages
        self._stop = stop or threading.Event()  # set: a pause in an outage ends at once
        self._delay = 0.0

    def read(self) -> list[Entry]:
        """Every entry from the cursor on, without waiting ([] during an outage)."""
        return self._advance(lambda: self.log.read(self.stream, self.job_id, self.position))

    def poll(self, timeout: float) -> list[Entry]:
        """The entries that exist or arrive within ``timeout`` ([] when none, or during an
        outage after the policy's pause)."""
        return self._advance(
            lambda: self.log.follow(
                self.stream,
                self.job_id,
                self.position,
                timeout,
                wake_on_routine=self.wake_on_routine,
            )
        )

    def _advance(self, fetch: Callable[[], list[Entry]]) -> list[Entry]:
        try:
            entries = fetch()
        except LogError as exc:
            self.last_error = exc
            self._delay = self.retry.next_delay(self._delay)
            log.warning(
                "log unavailable, retrying",
                stream=self.stream.value,
                error=str(exc),
                retry_in_s=self._delay,
            )
            self._stop.wait(self._delay)
            return []
        self._delay = 0.0
        if entries:
            self.position = entries[-1].position + 1
        return entries


def append_through_outage(
    connector: LogConnector,
    stream: Stream,
    record: Envelope,
    patience_s: float,
    retry: RetryPolicy = RETRY,
) -> int:
    """Append, retrying by ``retry`` while the log is away (a broker restart) for up to
    ``patience_s``: what a writer that must not lose a record does. Safe to retry: a refused
    append stored nothing (every backend settles an append before it answers), so the record
    is stored once. Raises the last LogError when patience runs out."""
    return _through_outage(lambda: connector.append(stream, record), patience_s, retry)


def append_many_through_outage(
    connector: LogConnector,
    stream: Stream,
    records: Sequence[Envelope],
    patience_s: float,
    retry: RetryPolicy = RETRY,
    *,
    routine: bool = False,
) -> list[int]:
    """``append_through_outage`` for one batch (``LogConnector.append_many``). A backend that
    stores a batch record by record (Kafka) may have stored part of a refused batch: that part
    is stored twice, and the engine rejects a record repeated (a step committed twice)."""
    return _through_outage(
        lambda: connector.append_many(stream, records, routine=routine),
        patience_s,
        retry,
    )


def _through_outage(append: Callable[[], T], patience_s: float, retry: RetryPolicy) -> T:
    deadline = time.monotonic() + patience_s
    delay = 0.0
    while True:
        try:
            return append()
        except LogError as exc:
            delay = retry.next_delay(delay)
            if time.monotonic() + delay > deadline:
                raise
            log.warning("log unavailable, retrying an append", error=str(exc), retry_in_s=delay)
            time.sleep(delay)
