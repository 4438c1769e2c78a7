"""The one interface every event-log backend implements.

A log holds two streams (events, decisions); each record belongs to one job. Positions are
integers that grow strictly within a (stream, job); they need not be dense, and they are what a
decision's ``caused_by`` and ``replay --until`` refer to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flashrecovery.connectors.chain import ChainWriter
from flashrecovery.connectors.signing import Keyring
from flashrecovery.errors import RecordError
from flashrecovery.records import Envelope, Stream, parse_record


@dataclass(frozen=True)
class Entry:
    """One stored record at its position. ``record`` is None when the stored value is not a
    valid record (written by some other tool); ``error`` then says why."""

    position: int
    raw: bytes
    record: Envelope | None
    error: str | None = None

    @classmethod
    def decode(cls, position: int, raw: bytes, stream: Stream) -> Entry:
        try:
            return cls(position, raw, parse_record(raw, stream))
        except RecordError as exc:
            return cls(position, raw, None, exc.reason)


class LogConnector(ABC):
    """Append-only, per-job ordered log of records."""

    url: str

    def __init__(self) -> None:
        self._chains = ChainWriter()

    @property
    def write_hold_s(self) -> float:
        """How long an append may be held up by the log itself (a server it waits out) before
        it fails: the engine gives a writer its peers still hear that much longer."""
        return 0.0

    def append(self, stream: Stream, record: Envelope) -> int:
        """Store the record durably, linked into its writer's hash chain; return its position."""
        return self._chains.append(stream, record, self.append_raw)

    def append_many(
        self, stream: Stream, records: Sequence[Envelope], *, routine: bool = False
    ) -> list[int]:
        """Store one job's records durably as one batch (one commit, one acknowledgement: a
        writer that need not wait per record asks for this); their positions, in order.
        ``routine``: nothing has to act on these records at once (a step's records), so a
        follower that said so (``follow(wake_on_routine=False)``) need not be woken for them;
        they are as durable as any."""
        if not records:
            return []
        return self._chains.append_many(
            stream,
            records,
            lambda s, job_id, raws: self.append_raw_many(s, job_id, raws, routine=routine),
        )

    def append_raw_many(
        self, stream: Stream, job_id: str, raws: list[bytes], *, routine: bool = False
    ) -> list[int]:
        """Store a batch of bytes; backends that can commit a batch at once override this
        (``routine``: as in ``append_many``)."""
        return [self.append_raw(stream, job_id, raw) for raw in raws]

    def append_async(self, stream: Stream, record: Envelope) -> None:
        """Hand the record over and go on without waiting for it to be stored: for a writer
        that does not act on the record being stored (a heartbeat: losing one is what the
        detector tolerates). It is stored after this handle's earlier records of its writer and
        before its later ones, and durable once ``flush`` (or ``close``) has returned; one the
        log could not store is lost, and the next ``flush`` raises a LogError saying so. A
        LogError now means the log refused it at once (closed, or a full buffer)."""
        self._chains.publish(stream, [record], self.send_raw_many)

    def send_raw_many(
        self, stream: Stream, job_id: str, raws: list[bytes], lost: Callable[[], None]
    ) -> None:
        """Hand a batch of bytes over without waiting (``lost()`` if it turns out not stored);
        backends that cannot do better store it at once."""
        self.append_raw_many(stream, job_id, raws)

    def flush(self, timeout: float | None = None) -> None:  # noqa: B027 - nothing pending
        """Wait until every record handed to ``append_async`` is stored; a LogError if some
        could not be (they are lost) or ``timeout`` seconds passed first."""

    def fence(self, job_id: str) -> None:  # noqa: B027 - nothing to fence in one process
        """Make this handle the job's one writer of decisions from now on: the decisions an
        earlier writer (another engine, before a takeover) has not stored by now are never
        stored, and a read after this returns every one it did store. A handle fenced off in
        turn fails its next decision with a LogError. The engine calls it before it reads what
        was decided and starts deciding. Here: a log in one process has no writer to fence."""

    def sign_with(self, keys: Keyring) -> None:
        """Sign every record this handle appends from now on with its source's key
        (connectors/signing.py): what a job's writers do once they know its secret."""
        self._chains.keys = keys

    def chain_head(self, job_id: str, stream: Stream, source: str) -> str | None:
        """SHA-256 of the last record this handle appended for ``source`` in the job's stream."""
        return self._chains.head(job_id, stream, source)

    @abstractmethod
    def append_raw(self, stream: Stream, job_id: str, raw: bytes) -> int:
        """Store bytes as they are (tests and foreign writers); readers flag them if invalid."""

    @abstractmethod
    def read(
        self, stream: Stream, job_id: str, from_position: int = 0, limit: int | None = None
    ) -> list[Entry]:
        """Entries of the job at positions >= from_position, in order."""

    @abstractmethod
    def follow(
        self,
        stream: Stream,
        job_id: str,
        from_position: int,
        timeout: float,
        *,
        wake_on_routine: bool = True,
    ) -> list[Entry]:
        """Like read, but block up to ``timeout`` seconds until at least one entry exists.
        ``wake_on_routine=False``: a backend may let routine records (``append_many``) wait
        until the timeout or the next record that is not routine, and return them then."""

    @abstractmethod
    def jobs(self) -> list[str]:
        """Ids of the jobs that have at least one record, sorted."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Store what ``append_async`` handed over (as far as the log takes it), release
        connections; the stored records stay."""

    def __enter__(self) -> LogConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
