"""A reader's view of a job's log in which a record not signed by the source it claims reads as
what it is to the job: not a record (connectors/signing.py).

For the tools that follow a job from outside and must see what its engine believes (the demo's
and chaos command's watch, their verdicts): a forged record there becomes an entry with no
record and an error saying why, as a malformed one already is, so every reader that skips
malformed entries skips it too, and positions run on unchanged.
"""

from __future__ import annotations

from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.connectors.signing import Keyring
from flashrecovery.errors import LogError
from flashrecovery.records import Stream


class BelievedLog(LogConnector):
    """``log`` as the holder of ``keys`` believes it; for reading only."""

    def __init__(self, log: LogConnector, keys: Keyring) -> None:
        super().__init__()
        self.inner, self.keys, self.url = log, keys, log.url

    def _believed(self, entries: list[Entry]) -> list[Entry]:
        out = []
        for entry in entries:
            why = None if entry.record is None else self.keys.forgery(entry.raw, entry.record)
            out.append(entry if why is None else Entry(entry.position, entry.raw, None, why))
        return out

    def append_raw(self, stream: Stream, job_id: str, raw: bytes) -> int:
        raise LogError("a believed view of a log is for reading")

    def read(
        self, stream: Stream, job_id: str, from_position: int = 0, limit: int | None = None
    ) -> list[Entry]:
        return self._believed(self.inner.read(stream, job_id, from_position, limit))

    def follow(
        self,
        stream: Stream,
        job_id: str,
        from_position: int,
        timeout: float,
        *,
        wake_on_routine: bool = True,
    ) -> list[Entry]:
        entries = self.inner.follow(
            stream, job_id, from_position, timeout, wake_on_routine=wake_on_routine
        )
        return self._believed(entries)

    def jobs(self) -> list[str]:
        return self.inner.jobs()
