"""Writing hash chains over a job's log, and the seal the job's last record puts on them
(checking them is a reader's work: replay/verify.py).

Several processes append to one stream at once (ranks, agent, engine, detectors), so one chain
per stream would need every writer to agree on its head: a lock across processes and hosts that
the log does not offer. The chain is therefore per *writer*: one log handle's records of one
``source`` within one (job, stream). A writer keeps its head in memory and stamps each record
with a ``ChainLink``: its writer id, its sequence number and the SHA-256 of the writer's
previous record as stored (and, once the handle holds the job's keys, its signature:
signing.py). The writer's appends are serialized by a lock held across the
append, so its records lie in the log in chain order.

Changing a stored record changes its hash, which its writer's next record no longer names;
losing a record leaves a gap in its writer's sequence numbers. The agent's JobFinished record
seals the log: it names every writer's head (last sequence number and hash) and, per committed
step, which ranks committed it, so a lost or changed final record of any writer is caught too.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from flashrecovery.connectors.signing import PLACEHOLDER, Keyring
from flashrecovery.records import (
    ChainHead,
    ChainLink,
    CommitRun,
    Envelope,
    StepCompleted,
    Stream,
    dump_record,
)

if TYPE_CHECKING:
    from flashrecovery.connectors.base import Entry, LogConnector

Store = Callable[[Stream, str, bytes], int]  # (stream, job id, raw) -> position
StoreMany = Callable[[Stream, str, list[bytes]], list[int]]  # one durable batch -> positions
# (stream, job id, raws, lost): hand a batch over without waiting; call lost() if it is lost.
Send = Callable[[Stream, str, list[bytes], Callable[[], None]], None]
T = TypeVar("T")


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


@dataclass
class _Head:
    seq: int
    hash: str


class ChainWriter:
    """The chain heads of one log handle in one process: one chain per (job, stream, source).
    A process that forks gets new writer ids (two processes must never extend one chain)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self.keys: Keyring | None = None  # signs every record linked from then on
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._token = secrets.token_hex(3)
        self._heads: dict[tuple[str, Stream, str], _Head] = {}
        self._locks: dict[tuple[str, Stream, str], threading.Lock] = {}
        # A failed store may still have stored part of its batch (an acknowledgement lost on
        # the way): the writer's chain then goes on under a new writer id instead of forking.
        self._restarts: Counter[tuple[str, Stream, str]] = Counter()
        self._lost: set[tuple[str, Stream, str]] = set()  # published, then lost: restart them

    def _lock(self, key: tuple[str, Stream, str]) -> threading.Lock:
        with self._guard:
            if self._pid != os.getpid():
                self._reset()
            return self._locks.setdefault(key, threading.Lock())

    def head(self, job_id: str, stream: Stream, source: str) -> str | None:
        """The hash of the last record this handle stored for ``source`` (None: none yet)."""
        head = self._heads.get((job_id, Stream(stream), source))
        return head.hash if head else None

    def append(self, stream: Stream, record: Envelope, store: Store) -> int:
        """Link the record to its writer's head, store it, and advance the head once stored."""
        [position] = self.append_many(
            stream, [record], lambda s, job, raws: [store(s, job, raw) for raw in raws]
        )
        return position

    def append_many(
        self, stream: Stream, records: Sequence[Envelope], store: StoreMany
    ) -> list[int]:
        """Link a batch of one job's records in order (each writer's chain runs through it),
        store it as one, and advance the heads once it is stored."""
        return self._linked(stream, records, store)

    def publish(self, stream: Stream, records: Sequence[Envelope], send: Send) -> None:
        """Link a batch and hand it to ``send``, which does not wait for it to be stored. If
        ``send`` finds out later that the batch was lost it calls the ``lost`` it was given: the
        writers' chains then go on under new writer ids from their next record (the records
        linked meanwhile leave a gap, which verify reports: records were lost)."""
        keys = self._keys(Stream(stream), records)

        def lost() -> None:  # may run on the backend's I/O thread: never waits for a key lock
            with self._guard:
                self._lost.update(keys)

        self._linked(stream, records, lambda s, job, raws: send(s, job, raws, lost))

    @staticmethod
    def _keys(stream: Stream, records: Sequence[Envelope]) -> list[tuple[str, Stream, str]]:
        if len(records) == 1:  # the common case, kept cheap
            return [(records[0].job_id, stream, records[0].source)]
        job_ids = {record.job_id for record in records}
        if len(job_ids) != 1:
            raise ValueError(f"a batch holds the records of one job, not {sorted(job_ids)}")
        return sorted({(record.job_id, stream, record.source) for record in records})

    def _restart(self, key: tuple[str, Stream, str]) -> None:
        """The key's chain goes on under a new writer id (its lock is held)."""
        self._heads.pop(key, None)
        self._restarts[key] += 1

    def _linked(self, stream: Stream, records: Sequence[Envelope], store: Callable[..., T]) -> T:
        stream = Stream(stream)
        keys = self._keys(stream, records)
        locks = [self._lock(key) for key in keys]  # in one order: no two batches deadlock
        for lock in locks:
            lock.acquire()
        try:
            if self._lost:  # an unlocked peek: lost() only ever adds
                with self._guard:
                    lost, self._lost = self._lost & set(keys), self._lost - set(keys)
                for key in lost:
                    self._restart(key)
            heads = {key: self._heads.get(key) for key in keys}
            raws = []
            for record in records:
                key = (record.job_id, stream, record.source)
                head = heads[key]
                restart = f".{self._restarts[key]}" if self._restarts[key] else ""
                link = ChainLink(
                    writer=f"{record.source}/{self._token}{restart}",
                    seq=head.seq + 1 if head else 0,
                    prev=head.hash if head else "",
                    mac=PLACEHOLDER if self.keys else "",
                )
                raw = dump_record(record.model_copy(update={"chain": link}))
                if self.keys is not None:
                    raw = self.keys.sign(record.job_id, record.source, raw)
                raws.append(raw)
                heads[key] = _Head(link.seq, digest(raw))
            try:
                stored = store(stream, records[0].job_id, raws)
            except BaseException:
                for key in keys:
                    self._restart(key)
                raise
            self._heads.update({key: head for key, head in heads.items() if head is not None})
        finally:
            for lock in reversed(locks):
                lock.release()
        return stored


# ------------------------------------------------------------------ the seal


@dataclass
class Tip:
    """A writer's last record seen: its sequence number, hash and position."""

    seq: int
    hash: str
    position: int


def _tips(entries: Iterable[Entry]) -> dict[str, Tip]:
    """Each writer's last record in one stream's entries."""
    out: dict[str, Tip] = {}
    for entry in entries:
        link = entry.record.chain if entry.record is not None else None
        if link is not None:
            out[link.writer] = Tip(link.seq, digest(entry.raw), entry.position)
    return out


def heads(streams: Mapping[Stream, list[Entry]]) -> list[ChainHead]:
    """The seal's chain heads: every writer's last record on each stream."""
    return [
        ChainHead(stream=stream.value, writer=writer, seq=tip.seq, hash=tip.hash)
        for stream, entries in streams.items()
        for writer, tip in sorted(_tips(entries).items())
    ]


def commit_runs(events: Iterable[Entry]) -> list[CommitRun]:
    """Which ranks committed each step, as runs of consecutive steps with the same ranks."""
    by_step: dict[int, set[int]] = {}
    for entry in events:
        if isinstance(entry.record, StepCompleted):
            by_step.setdefault(entry.record.step, set()).add(entry.record.rank)
    runs: list[CommitRun] = []
    for step in sorted(by_step):
        ranks = sorted(by_step[step])
        last = runs[-1] if runs else None
        if last is not None and last.last_step == step - 1 and last.ranks == ranks:
            runs[-1] = last.model_copy(update={"last_step": step})
        else:
            runs.append(CommitRun(first_step=step, last_step=step, ranks=ranks))
    return runs


def seal(log: LogConnector, job_id: str) -> dict[str, Any]:
    """The fields of the JobFinished record that seal the job's log as it stands."""
    streams = read_streams(log, job_id)
    return {"chain_heads": heads(streams), "committed": commit_runs(streams[Stream.EVENTS])}


def read_streams(log: LogConnector, job_id: str) -> dict[Stream, list[Entry]]:
    return {stream: log.read(stream, job_id) for stream in Stream}
