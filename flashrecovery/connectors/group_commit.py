"""Group commit: records handed over without waiting, stored together by one background thread.

A writer that does not wait per record (``LogConnector.append_async``) queues its batch here and
goes on. The committer thread takes everything queued while its previous commit ran and stores it
with one ``commit`` call (one transaction, one fsync on the embedded log), so the cost of a
durable commit is shared by every record that arrived meanwhile: the busier the writer, the
bigger the group, without a fixed window adding latency when it is idle.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from flashrecovery.errors import LogError
from flashrecovery.records import Stream

MAX_GROUP = 10_000  # records per commit at most, so one transaction stays short


@dataclass(frozen=True)
class Batch:
    """One ``append_async`` call's records of one job, and whom to tell if they are lost."""

    stream: Stream
    job_id: str
    raws: list[bytes]
    lost: Callable[[], None]


Commit = Callable[[list[Batch]], None]  # store the batches as one; raise if nothing was stored


class GroupCommitter:
    def __init__(self, commit: Commit, name: str) -> None:
        self._commit = commit
        self._changed = threading.Condition()
        self._queue: deque[Batch] = deque()
        self._queued = 0  # batches ever queued …
        self._settled = 0  # … and ever committed or lost, in queue order
        self._failures: list[str] = []  # why batches were lost, until flush reports them
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, batch: Batch) -> None:
        with self._changed:
            if self._closing:
                raise LogError("the log is closed: nothing more can be handed over")
            self._queue.append(batch)
            self._queued += 1
            if len(self._queue) == 1:  # the committer waits only on an empty queue
                self._changed.notify_all()

    @property
    def pending(self) -> bool:
        with self._changed:
            return self._settled < self._queued

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every batch queued so far is settled; a LogError names the lost ones."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            target = self._queued
            while self._settled < target:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise LogError(
                        f"{target - self._settled} batch(es) handed over were not committed "
                        f"within {timeout} s"
                    )
                self._changed.wait(remaining)
            failures, self._failures = self._failures, []
        if failures:
            raise LogError(
                f"{len(failures)} batch(es) handed over without waiting were not stored "
                f"(lost): {failures[0]}"
            )

    def close(self, timeout: float) -> None:
        """Commit what is queued (within ``timeout``), then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return  # closing, and everything is settled
                group, taken = [], 0
                while self._queue and taken < MAX_GROUP:
                    taken += len(self._queue[0].raws)
                    group.append(self._queue.popleft())
            try:
                self._commit(group)
                failure = None
            except Exception as exc:  # a LogError or a bug: either way these are not stored
                failure = f"{type(exc).__name__}: {exc}"
                for batch in group:
                    batch.lost()
            with self._changed:
                if failure is not None:
                    self._failures.append(failure)
                self._settled += len(group)
                self._changed.notify_all()
