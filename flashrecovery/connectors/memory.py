"""In-process log for unit tests of pure logic: a list per stream behind a condition variable."""

from __future__ import annotations

import threading

from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.records import Stream


class MemoryLog(LogConnector):
    def __init__(self, url: str = "memory://") -> None:
        super().__init__()
        self.url = url
        self._entries: dict[Stream, list[tuple[str, bytes]]] = {s: [] for s in Stream}
        self._changed = threading.Condition()

    def append_raw(self, stream: Stream, job_id: str, raw: bytes) -> int:
        with self._changed:
            entries = self._entries[Stream(stream)]
            entries.append((job_id, bytes(raw)))
            self._changed.notify_all()
            return len(entries) - 1

    def read(
        self, stream: Stream, job_id: str, from_position: int = 0, limit: int | None = None
    ) -> list[Entry]:
        stream = Stream(stream)
        with self._changed:
            rows = list(enumerate(self._entries[stream]))[max(from_position, 0) :]
        out = [Entry.decode(pos, raw, stream) for pos, (job, raw) in rows if job == job_id]
        return out if limit is None else out[:limit]

    def follow(
        self,
        stream: Stream,
        job_id: str,
        from_position: int,
        timeout: float,
        *,
        wake_on_routine: bool = True,
    ) -> list[Entry]:
        with self._changed:
            self._changed.wait_for(
                lambda: any(
                    job == job_id
                    for job, _ in self._entries[Stream(stream)][max(from_position, 0) :]
                ),
                timeout=timeout,
            )
        return self.read(stream, job_id, from_position)

    def jobs(self) -> list[str]:
        with self._changed:
            return sorted({job for entries in self._entries.values() for job, _ in entries})
