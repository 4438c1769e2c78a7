"""The embedded log, the default backend: one SQLite file in WAL mode, shared by every process.

URL: everything after ``sqlite://`` is the file path, so ``sqlite:///abs/path/run.db`` names
``/abs/path/run.db`` (``sqlite:////abs/path/run.db`` means the same) and ``sqlite://runs/run.db``
names ``runs/run.db`` relative to the working directory at open time. The only query option is
``timeout`` (seconds a writer waits for the write lock, default 30).

Why it is safe with many processes appending and following at once:

- every thread of every process has its own connection (SQLite connections must not be shared
  across threads in use, nor across fork);
- WAL lets readers and followers run while one writer appends; appends take the write lock up
  front (``BEGIN IMMEDIATE``) so they queue on ``busy_timeout`` instead of failing half-way;
- ``synchronous=FULL`` fsyncs the WAL on every commit, so a record survives a power loss once
  ``append`` has returned (NORMAL would only survive a process crash, and the engine acts on a
  decision's position as soon as it is written); the cost is a fraction of a millisecond here.
  A *routine* batch (``append_many(routine=True)``: the agent's step records, one commit per
  step) is the exception: it is committed without an fsync of its own unless this connection's
  last fsync is ``ROUTINE_SYNC_S`` old, and is durable against a power loss with the next
  fsynced commit of any writer (an agent's heartbeats commit with one every interval): an fsync
  of the WAL covers every frame before it, and SQLite recovers a WAL up to its first torn frame,
  so what a power loss leaves is always a prefix of the log. The log is one host's file: a
  power loss that takes a step's record takes the job's every process with it.
- ``append_many`` is one transaction, one fsync; ``append_async`` queues for a group committer
  (connectors/group_commit.py) that commits what queued meanwhile in one transaction: durable
  once ``flush`` returns, lost if the process dies first (docs/kafka.md, "what each write
  promises").
- a follower wakes when a commit to its stream rings that stream's signal file
  (connectors/commit_signal.py), in any process; without inotify it polls.

Positions are the AUTOINCREMENT rowid of the stream's table: strictly increasing, never reused,
not dense per job.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.connectors.commit_signal import Signaller, Waiter
from flashrecovery.connectors.group_commit import Batch, GroupCommitter
from flashrecovery.errors import LogError
from flashrecovery.records import Stream

SCHEMA_VERSION = 1
DEFAULT_TIMEOUT_S = 30.0
# Without inotify, follow's first wait; doubles up to MAX_POLL_S. 5 ms, not 1: a follower of a
# job's events (the agent's engine) starts a follow after every step's records, and polls before
# the next step's came cost the agent CPU that the ranks share (docs/benchmarks.md, "Where the
# time goes").
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.02
SIGNAL_LOOK_S = 1.0  # with inotify, how often a follower also looks without being rung
# A routine commit skips its fsync while this connection's last one is younger: the agent's
# commit per step then costs 40 % less CPU on the cores the ranks train on
# (docs/benchmarks.md, "Where the time goes").
ROUTINE_SYNC_S = 1.0
_PREFIX = "sqlite://"
_OPTIONS = ("timeout",)

_SCHEMA = (
    *(
        f"CREATE TABLE IF NOT EXISTS {stream.value} (position INTEGER PRIMARY KEY AUTOINCREMENT,"
        " job_id TEXT NOT NULL, raw BLOB NOT NULL)"
        for stream in Stream
    ),
    *(
        f"CREATE INDEX IF NOT EXISTS {stream.value}_job ON {stream.value} (job_id, position)"
        for stream in Stream
    ),
    "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY) WITHOUT ROWID",
)

# Connections inherited through fork belong to the parent's SQLite state: the child must neither
# use nor close them, so they are parked here for the life of the process.
_INHERITED: list[sqlite3.Connection] = []


def _parse_url(url: str) -> tuple[Path, float]:
    """The database path and busy timeout a ``sqlite://`` URL names; a LogError says why not."""
    if not isinstance(url, str) or not url.startswith(_PREFIX):
        raise LogError(
            f"log URL {url!r} is not an embedded log URL: expected sqlite:///path/run.db"
        )
    rest = url[len(_PREFIX) :]
    if "#" in rest:
        raise LogError(f"log URL {url!r} has a fragment ('#…'); sqlite URLs take none")
    rest, _, query = rest.partition("?")
    path = unquote(rest)
    if not path:
        raise LogError(
            f"log URL {url!r} names no database file: use sqlite:///abs/path/run.db "
            "or sqlite://relative/path/run.db"
        )
    if path.endswith("/"):
        raise LogError(f"log URL {url!r} names a directory, not a database file")
    if path.startswith("//"):  # the sqlite:////abs/path spelling
        path = "/" + path.lstrip("/")
    timeout = DEFAULT_TIMEOUT_S
    if query:
        try:
            options = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            raise LogError(f"log URL {url!r} has a malformed query {query!r}") from None
        for key, value in options:
            if key != "timeout":
                raise LogError(
                    f"log URL {url!r} has unknown option {key!r}; supported: " + ", ".join(_OPTIONS)
                )
            try:
                timeout = float(value)
            except ValueError:
                timeout = -1.0
            if not timeout > 0 or timeout == float("inf"):
                raise LogError(
                    f"log URL {url!r}: timeout must be a positive number of seconds, got {value!r}"
                )
    return Path(os.path.abspath(path)), timeout


class _Connection:
    """One thread's connection, with a lock that ``close`` takes to wait out a running query,
    and the thread's waiters for commits (a follow's, per stream)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.thread = threading.current_thread()
        self.waiters: dict[tuple[Stream, bool], Waiter] = {}  # (stream, urgent only)
        self.fsyncs = True  # whether its commits fsync now (PRAGMA synchronous FULL/NORMAL)
        self.synced_at = time.monotonic()  # its last fsynced commit (or its opening)

    def fsync_commits(self, routine: bool) -> None:
        """Set whether the next commit fsyncs: every one that is not routine, and a routine
        one once the last fsync is ROUTINE_SYNC_S old (the module's docstring says why)."""
        now = time.monotonic()
        fsyncs = not routine or now - self.synced_at >= ROUTINE_SYNC_S
        if fsyncs != self.fsyncs:
            self.db.execute(f"PRAGMA synchronous={'FULL' if fsyncs else 'NORMAL'}")
            self.fsyncs = fsyncs
        if fsyncs:
            self.synced_at = now

    def close_waiters(self) -> None:
        waiters, self.waiters = list(self.waiters.values()), {}
        for waiter in waiters:
            waiter.close()

    def close(self) -> None:
        with self.lock:
            self.db.close()
            self.close_waiters()


class EmbeddedLog(LogConnector):
    """Append-only log in one SQLite file; a table per stream, one connection per thread."""

    def __init__(
        self,
        path: Path,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        url: str = "",
        read_only: bool = False,
    ) -> None:
        super().__init__()
        self.path = path
        self.read_only = read_only  # a reader's: opens a log that exists, changes no byte
        self.timeout = timeout
        self.url = url or f"{_PREFIX}{path}"
        self._local = threading.local()
        self._connections: list[_Connection] = []
        self._registry = threading.Lock()
        self._closed = False
        self._committer: GroupCommitter | None = None  # started by the first append_async
        self._committer_pid = os.getpid()
        self._signaller = Signaller(path)
        self._connection()  # create the file and schema now, so a bad path fails at open

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False) -> EmbeddedLog:
        path, timeout = _parse_url(url)
        if read_only and not path.is_file():
            raise LogError(f"no log at {path} (from {url})")
        return cls(path, timeout=timeout, url=url, read_only=read_only)

    # ------------------------------------------------------------ connections

    def _connection(self) -> _Connection:
        if self._closed:
            raise LogError(f"log {self.url} is closed")
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.pid == os.getpid():
            return conn
        conn = _Connection(self._open())
        self._local.conn = conn
        with self._registry:
            ended = self._release_ended()
            self._connections.append(conn)
        for old in ended:
            old.close()
        if self._closed:  # close() ran while this one was being opened
            conn.close()
            raise LogError(f"log {self.url} is closed")
        return conn

    def _release_ended(self) -> list[_Connection]:
        """Drop from the registry the connections this thread-set can no longer use: those of
        finished threads (returned, to be closed) and those inherited through fork (parked)."""
        pid = os.getpid()
        live, ended = [], []
        for conn in self._connections:
            if conn.pid != pid:
                _INHERITED.append(conn.db)
                for waiter in conn.waiters.values():
                    waiter.forget()  # this process's copies; the parent's wait goes on
            elif conn.thread.is_alive():
                live.append(conn)
            else:
                ended.append(conn)
        self._connections = live
        return ended

    def _open(self) -> sqlite3.Connection:
        try:
            if not self.read_only:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(
                f"file:{quote(str(self.path))}?mode={'ro' if self.read_only else 'rwc'}",
                uri=True,
                timeout=self.timeout,
                isolation_level=None,
                check_same_thread=False,
            )
        except (OSError, sqlite3.Error) as exc:
            raise LogError(f"cannot open log {self.url} ({self.path}): {exc}") from None
        try:
            if self.read_only:
                self._check_is_log(db)
            else:
                self._prepare(db)
        except sqlite3.Error as exc:
            db.close()
            if self.read_only:
                raise LogError(f"{self.path} is not a flashrecovery log ({exc})") from None
            raise LogError(f"cannot use log {self.url} ({self.path}): {exc}") from None
        return db

    def _prepare(self, db: sqlite3.Connection) -> None:
        """WAL, durable commits, and the schema (created once, by whichever process is first)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as exc:
                # Switching a new file to WAL needs an exclusive lock; a concurrent opener may hold
                # it briefly, and SQLite does not always run the busy handler for this pragma.
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(FIRST_POLL_S)
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot switch to WAL mode (journal_mode={mode})")
        db.execute("PRAGMA synchronous=FULL")
        if self._schema_version(db) == SCHEMA_VERSION:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            self._schema_version(db)  # another process may have upgraded it meanwhile
            for statement in _SCHEMA:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _check_is_log(self, db: sqlite3.Connection) -> None:
        """A reader's check, which writes nothing: the file holds flashrecovery's tables (a
        file of another program, or an empty one, is named as such, never given them)."""
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
        wanted = {*(stream.value for stream in Stream), "jobs"}
        if self._schema_version(db) != SCHEMA_VERSION or not wanted <= tables:
            db.close()
            raise LogError(f"{self.path} is not a flashrecovery log (from {self.url})")

    @staticmethod
    def _schema_version(db: sqlite3.Connection) -> int:
        version: int = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(
                f"schema version {version} was written by a newer flashrecovery "
                f"(this build knows {SCHEMA_VERSION})"
            )
        return version

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, held for one operation; SQLite errors become LogErrors."""
        with self._held() as conn:
            yield conn.db

    @contextmanager
    def _held(self) -> Iterator[_Connection]:
        conn = self._connection()
        with conn.lock:
            if self._closed:
                raise LogError(f"log {self.url} is closed")
            try:
                yield conn
            except sqlite3.Error as exc:
                raise LogError(f"log {self.url}: {exc}") from None

    # ------------------------------------------------------------ interface

    def append_raw(self, stream: Stream, job_id: str, raw: bytes) -> int:
        [position] = self.append_raw_many(stream, job_id, [raw])
        return position

    def append_raw_many(
        self, stream: Stream, job_id: str, raws: list[bytes], *, routine: bool = False
    ) -> list[int]:
        """One transaction, so one fsync, for the whole batch; after what this handle's
        ``append_async`` queued (a writer's records lie in the log in its order). A routine
        batch rings only its stream's signal, not the urgent one (commit_signal.py)."""
        committer = self._committer_of_this_process()
        if committer is not None and committer.pending:
            committer.flush(self.timeout)
        [positions] = self._insert([(Stream(stream), job_id, raws)], routine=routine)
        return positions

    def send_raw_many(
        self, stream: Stream, job_id: str, raws: list[bytes], lost: Callable[[], None]
    ) -> None:
        """Queue for the group committer (connectors/group_commit.py): whatever queues while
        it commits is committed next, together, in one transaction."""
        committer = self._committer_of_this_process()
        if committer is None:
            if self._closed:
                raise LogError(f"log {self.url} is closed")
            committer = GroupCommitter(self._commit_group, name="flashrecovery-group-commit")
            self._committer = committer
        committer.put(Batch(Stream(stream), job_id, list(raws), lost))

    def flush(self, timeout: float | None = None) -> None:
        committer = self._committer_of_this_process()
        if committer is not None:
            committer.flush(timeout)

    def _committer_of_this_process(self) -> GroupCommitter | None:
        """A committer thread does not survive fork: a child queues to its own."""
        with self._registry:
            if self._committer is not None and self._committer_pid != os.getpid():
                self._committer = None
            if self._committer is None:
                self._committer_pid = os.getpid()
            return self._committer

    def _commit_group(self, group: list[Batch]) -> None:
        self._insert([(batch.stream, batch.job_id, batch.raws) for batch in group])

    def _insert(
        self, batches: list[tuple[Stream, str, list[bytes]]], routine: bool = False
    ) -> list[list[int]]:
        """Insert each (stream, job, raws) in one transaction (fsynced unless ``routine``:
        the module's docstring); the positions per batch."""
        out: list[list[int]] = []
        with self._held() as conn:
            db = conn.db
            conn.fsync_commits(routine)
            db.execute("BEGIN IMMEDIATE")
            try:
                for stream, job_id, raws in batches:
                    positions = []
                    for raw in raws:
                        cursor = db.execute(
                            f"INSERT INTO {stream.value} (job_id, raw) VALUES (?, ?)",
                            (job_id, bytes(raw)),
                        )
                        assert cursor.lastrowid is not None
                        positions.append(cursor.lastrowid)
                    out.append(positions)
                for job_id in {job_id for _, job_id, _ in batches}:
                    db.execute("INSERT OR IGNORE INTO jobs (job_id) VALUES (?)", (job_id,))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        for stream in {stream for stream, _, _ in batches}:
            self._signaller.ring(stream, routine)
        return out

    def read(
        self, stream: Stream, job_id: str, from_position: int = 0, limit: int | None = None
    ) -> list[Entry]:
        stream = Stream(stream)
        with self._db() as db:
            rows = self._select(db, stream, job_id, from_position, limit)
        return [Entry.decode(position, raw, stream) for position, raw in rows]

    def follow(
        self,
        stream: Stream,
        job_id: str,
        from_position: int,
        timeout: float,
        *,
        wake_on_routine: bool = True,
    ) -> list[Entry]:
        """Wait for a commit to the stream to ring its signal (commit_signal.py; without
        ``wake_on_routine`` only a commit that is not routine), or without inotify poll
        ``data_version`` (it changes when another connection commits) with a backoff from 5 ms
        to 20 ms; run the query again only after a change, and once more at the end of a wait
        (routine records are found then)."""
        stream = Stream(stream)
        waiter = self._waiter(stream, urgent=not wake_on_routine)
        deadline = time.monotonic() + max(timeout, 0.0)
        delay = FIRST_POLL_S
        while True:
            if waiter is not None:
                waiter.clear()  # a ring from now on is a commit the query below may miss
            with self._db() as db:
                version = self._data_version(db)
                rows = self._select(db, stream, job_id, from_position, None)
            if rows:
                return [Entry.decode(position, raw, stream) for position, raw in rows]
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                if waiter is not None and not waiter.lost:
                    waiter.wait(min(remaining, SIGNAL_LOOK_S))
                else:
                    time.sleep(min(delay, remaining))
                    delay = min(delay * 2, MAX_POLL_S)
                with self._db() as db:
                    if self._data_version(db) != version:
                        break

    def _waiter(self, stream: Stream, urgent: bool = False) -> Waiter | None:
        """This thread's waiter for commits to ``stream`` (``urgent``: those not routine; a
        new one if the old one's file went away), or None: then follow polls."""
        conn = self._connection()
        waiter = conn.waiters.get((stream, urgent))
        if waiter is not None and waiter.lost:
            waiter.close()
            waiter = None
            del conn.waiters[(stream, urgent)]
        if waiter is None:
            waiter = Waiter.open(self.path, stream, urgent)
            if waiter is not None:
                conn.waiters[(stream, urgent)] = waiter
        return waiter

    def jobs(self) -> list[str]:
        with self._db() as db:
            return [job for (job,) in db.execute("SELECT job_id FROM jobs ORDER BY job_id")]

    def close(self) -> None:
        """Close every thread's connection (waiting out a query in flight); later use is a
        LogError. The file and its records stay."""
        committer = self._committer_of_this_process()
        if committer is not None:  # commit what append_async queued, while connections work
            committer.close(self.timeout)
        self._closed = True
        with self._registry:
            ended = self._release_ended()
            connections, self._connections = self._connections, []
        for conn in ended + connections:
            conn.close()
        self._signaller.close()

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _select(
        db: sqlite3.Connection, stream: Stream, job_id: str, from_position: int, limit: int | None
    ) -> list[Any]:
        return db.execute(
            f"SELECT position, raw FROM {stream.value} WHERE job_id = ? AND position >= ? "
            "ORDER BY position LIMIT ?",
            (job_id, max(from_position, 0), -1 if limit is None else max(limit, 0)),
        ).fetchall()

    @staticmethod
    def _data_version(db: sqlite3.Connection) -> int:
        version: int = db.execute("PRAGMA data_version").fetchone()[0]
        return version
