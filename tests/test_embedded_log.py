"""What is particular to the embedded (SQLite) log: its URL, its file, its durability settings."""

from __future__ import annotations

import multiprocessing
import select
import sqlite3
import threading
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest

from flashrecovery.connectors import commit_signal, embedded, open_log
from flashrecovery.connectors.embedded import EmbeddedLog
from flashrecovery.errors import LogError
from flashrecovery.records import Heartbeat, IsolateRank, Stream
from flashrecovery.replay.verify import verify as verify_chains


def heartbeat(step: int) -> Heartbeat:
    return Heartbeat(job_id="job", generation=0, source="rank:0", rank=0, step=step, pid=1,
                     host="node0")  # fmt: skip


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite://", "names no database file"),
        ("sqlite://?timeout=5", "names no database file"),
        ("sqlite:///tmp/", "names a directory"),
        ("sqlite:///tmp/run.db?mode=ro", "unknown option 'mode'"),
        ("sqlite:///tmp/run.db?timeout", "malformed query"),
        ("sqlite:///tmp/run.db?timeout=soon", "timeout must be a positive number"),
        ("sqlite:///tmp/run.db?timeout=0", "timeout must be a positive number"),
        ("sqlite:///tmp/run.db#frag", "fragment"),
    ],
)
def test_malformed_url_is_a_log_error_that_says_why(url: str, message: str) -> None:
    with pytest.raises(LogError, match=message):
        open_log(url)


def test_url_forms_name_the_expected_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with EmbeddedLog.from_url(f"sqlite://{tmp_path}/abs/run.db") as log:
        assert isinstance(log, EmbeddedLog) and log.path == tmp_path / "abs" / "run.db"
    with EmbeddedLog.from_url(f"sqlite:///{tmp_path}/abs/run.db?timeout=2.5") as log:
        assert log.path == tmp_path / "abs" / "run.db"  # the sqlite:////abs spelling
        assert log.timeout == 2.5
    with EmbeddedLog.from_url("sqlite://rel/dir/run%20x.db") as log:
        assert log.path == tmp_path / "rel" / "dir" / "run x.db"
    assert (tmp_path / "rel" / "dir" / "run x.db").is_file()


def test_file_is_created_with_parents_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "run.db"
    with EmbeddedLog.from_url(f"sqlite://{path}") as log:
        log.append(Stream.EVENTS, heartbeat(0))
        with log._db() as own:  # FULL: the WAL is fsynced before append returns
            assert own.execute("PRAGMA synchronous").fetchone()[0] == 2
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT count(*) FROM events").fetchone()[0] == 1
    finally:
        db.close()


def test_a_routine_batch_is_fsynced_only_once_the_last_fsync_is_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's step records (routine) ride on the next fsync; every other commit fsyncs."""
    with EmbeddedLog.from_url(f"sqlite://{tmp_path}/run.db") as log:

        def last_commit_fsynced() -> bool:
            with log._db() as own:
                return bool(own.execute("PRAGMA synchronous").fetchone()[0] == 2)

        log.append(Stream.EVENTS, heartbeat(0))
        assert last_commit_fsynced()
        log.append_many(Stream.EVENTS, [heartbeat(1), heartbeat(2)], routine=True)
        assert not last_commit_fsynced()
        log.append_many(Stream.EVENTS, [heartbeat(3)], routine=True)
        assert not last_commit_fsynced()
        log.append(Stream.EVENTS, heartbeat(4))
        assert last_commit_fsynced()
        monkeypatch.setattr(embedded, "ROUTINE_SYNC_S", 0.0)  # the last fsync is old at once
        log.append_many(Stream.EVENTS, [heartbeat(5)], routine=True)
        assert last_commit_fsynced()
        steps = [e.record.step for e in log.read(Stream.EVENTS, "job")]
        assert steps == [0, 1, 2, 3, 4, 5]


def _open_and_append(url: str, start: Barrier, step: int) -> None:
    start.wait(30)
    with open_log(url) as log:
        log.append(Stream.EVENTS, heartbeat(step))


def test_processes_creating_the_file_at_once_all_succeed(tmp_path: Path) -> None:
    """The first opener switches the new file to WAL and creates the schema; the others wait."""
    url = f"sqlite://{tmp_path}/new/run.db"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    processes = [ctx.Process(target=_open_and_append, args=(url, start, i)) for i in range(4)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(30)
            assert process.exitcode == 0
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    with open_log(url) as log:
        steps = [
            e.record.step for e in log.read(Stream.EVENTS, "job") if isinstance(e.record, Heartbeat)
        ]
        assert sorted(steps) == [0, 1, 2, 3]


def test_a_file_that_is_not_a_database_is_a_log_error(tmp_path: Path) -> None:
    path = tmp_path / "run.db"
    path.write_bytes(b"this is not a sqlite database, just some bytes" * 100)
    with pytest.raises(LogError, match="cannot use log"):
        open_log(f"sqlite://{path}")


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(LogError, match="newer flashrecovery"):
        open_log(f"sqlite://{path}")


def test_each_thread_has_its_own_connection_and_close_ends_them_all(tmp_path: Path) -> None:
    log = EmbeddedLog.from_url(f"sqlite://{tmp_path}/run.db")
    log.append(Stream.EVENTS, heartbeat(0))
    seen: list[int] = []
    done = threading.Event()
    release = threading.Event()

    def reader() -> None:
        seen.append(len(log.read(Stream.EVENTS, "job")))
        done.set()
        release.wait(30)  # keep the thread (and its connection) alive until close

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        assert done.wait(30)
        assert seen == [1]
        assert len({id(c.db) for c in log._connections}) == 2
        log.close()
        with pytest.raises(LogError, match="closed"):
            log.read(Stream.EVENTS, "job")
    finally:
        release.set()
        thread.join(30)
    with open_log(f"sqlite://{tmp_path}/run.db") as again:
        assert len(again.read(Stream.EVENTS, "job")) == 1


def test_a_group_commit_that_fails_is_reported_lost_and_its_writers_chain_restarts(
    tmp_path: Path,
) -> None:
    """Another connection holds the write lock past the busy timeout: the queued record is not
    stored, flush says so, and the writer's next record starts a new chain instead of leaving
    a gap in the old one."""
    path = tmp_path / "run.db"
    with open_log(f"sqlite://{path}?timeout=0.2") as log:
        log.append(Stream.EVENTS, heartbeat(0))
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            log.append_async(Stream.EVENTS, heartbeat(1))
            with pytest.raises(LogError, match=r"1 batch\(es\) .* not stored \(lost\).*locked"):
                log.flush(timeout=30)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        log.flush(timeout=30)  # reported once
        log.append(Stream.EVENTS, heartbeat(2))
        entries = log.read(Stream.EVENTS, "job")
    records = [e.record for e in entries if isinstance(e.record, Heartbeat)]
    assert [r.step for r in records] == [0, 2]
    first, after = (r.chain for r in records)
    assert first is not None and after is not None
    assert after.writer != first.writer and after.seq == 0
    assert verify_chains({Stream.EVENTS: entries}).ok


def _isolate(caused_by: int) -> IsolateRank:
    return IsolateRank(job_id="job", generation=0, source="engine", caused_by=caused_by, rank=0,
                       reason="test")  # fmt: skip


def _append_then_decide(url: str, start: int) -> None:
    """Another process's writer (spawned: module level): an event, then a decision."""
    with open_log(url) as log:
        log.append(Stream.EVENTS, heartbeat(1))
        log.append(Stream.DECISIONS, _isolate(start))


@pytest.fixture
def no_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every look of a follower's own a minute apart: only a ring can end a follow in time."""
    monkeypatch.setattr(embedded, "FIRST_POLL_S", 60.0)
    monkeypatch.setattr(embedded, "MAX_POLL_S", 60.0)
    monkeypatch.setattr(embedded, "SIGNAL_LOOK_S", 60.0)


def _following(log: EmbeddedLog, stream: Stream, got: list[object]) -> threading.Thread:
    """A thread following ``stream`` from the start, once it has looked and begun to wait; it
    puts in ``got`` the positions it found, or its LogError's message."""
    looked = threading.Event()
    original = log._waiter

    def waiter(stream: Stream, urgent: bool = False) -> commit_signal.Waiter | None:
        found = original(stream, urgent)
        looked.set()
        return found

    log._waiter = waiter  # type: ignore[method-assign]

    def follow() -> None:
        try:
            entries = log.follow(stream, "job", 0, timeout=120.0)
        except LogError as exc:
            got.append(str(exc))
        else:
            got.append([entry.position for entry in entries])

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    assert looked.wait(10.0)
    return thread


@pytest.mark.parametrize("writer", ["this process", "another process"])
@pytest.mark.usefixtures("no_polling")
def test_a_follower_wakes_on_a_commit_to_its_stream_without_polling(
    tmp_path: Path, writer: str
) -> None:
    """The agent's engine and its decisions relay are two handles in one process; an external
    engine, another agent on the host or ``flashrecovery`` tools write from other processes."""
    url = f"sqlite:///{tmp_path / 'run.db'}"
    with EmbeddedLog.from_url(url) as follower_log, EmbeddedLog.from_url(url) as writer_log:
        start = writer_log.append(Stream.EVENTS, heartbeat(0))
        got: list[object] = []
        thread = _following(follower_log, Stream.DECISIONS, got)
        if writer == "this process":
            writer_log.append(Stream.EVENTS, heartbeat(1))
            writer_log.append(Stream.DECISIONS, _isolate(start))
        else:
            process = multiprocessing.get_context("spawn").Process(
                target=_append_then_decide, args=(url, start)
            )
            process.start()
            process.join(60)
            assert process.exitcode == 0
        thread.join(30.0)
        assert not thread.is_alive(), "the follower slept through the commit"
        [decision] = writer_log.read(Stream.DECISIONS, "job")
        assert got == [[decision.position]]


def test_a_commit_rings_only_the_streams_it_wrote(tmp_path: Path) -> None:
    """A step's records do not wake a follower of the decisions (the agent's relay)."""
    path = tmp_path / "run.db"
    with EmbeddedLog.from_url(f"sqlite:///{path}") as log:
        waiters = {stream: commit_signal.Waiter.open(path, stream) for stream in Stream}
        rung = {}
        log.append(Stream.EVENTS, heartbeat(0))
        for stream, waiter in waiters.items():
            assert waiter is not None
            readable, _, _ = select.select([waiter._fd], [], [], 0)
            rung[stream] = bool(readable)
            waiter.close()
    assert rung == {Stream.EVENTS: True, Stream.DECISIONS: False}


@pytest.mark.usefixtures("no_polling")
def test_a_follower_that_skips_routine_wakes_finds_routine_records_when_its_wait_ends(
    tmp_path: Path,
) -> None:
    """The engine follows with ``wake_on_routine=False``: a step's records (routine) do not
    wake it, they are read at its next look; anything else wakes it at once. Every other
    follower is woken by every commit, as before."""
    url = f"sqlite:///{tmp_path / 'run.db'}"
    with EmbeddedLog.from_url(url) as follower_log, EmbeddedLog.from_url(url) as writer_log:
        got: list[list[int]] = []

        def follow(timeout: float, wake_on_routine: bool) -> threading.Thread:
            looked = threading.Event()
            original = follower_log._select

            def spy(*args: Any) -> list[Any]:
                rows = original(*args)
                looked.set()  # its first look is done: it waits now
                return rows

            follower_log._select = spy  # type: ignore[method-assign]
            start = len(writer_log.read(Stream.EVENTS, "job")) + 1

            def run() -> None:
                entries = follower_log.follow(
                    Stream.EVENTS, "job", start, timeout, wake_on_routine=wake_on_routine
                )
                got.append([entry.position for entry in entries])

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            assert looked.wait(10.0)
            follower_log._select = original  # type: ignore[method-assign]
            return thread

        # routine: found when the wait (1 s) ends; a ring would have ended it at once too,
        # so the urgent signal is checked as well: it did not ring
        urgent = commit_signal.Waiter.open(tmp_path / "run.db", Stream.EVENTS, urgent=True)
        assert urgent is not None
        thread = follow(timeout=1.0, wake_on_routine=False)
        [routine] = writer_log.append_many(Stream.EVENTS, [heartbeat(0)], routine=True)
        thread.join(30.0)
        assert not select.select([urgent._fd], [], [], 0)[0], "a routine commit rang urgently"
        urgent.close()
        # not routine: wakes it although its wait is long
        thread = follow(timeout=120.0, wake_on_routine=False)
        other = writer_log.append(Stream.EVENTS, heartbeat(1))
        thread.join(30.0)
        assert not thread.is_alive(), "a commit that is not routine did not wake it"
        # a follower that wakes on routine commits is woken by one at once
        thread = follow(timeout=120.0, wake_on_routine=True)
        [last] = writer_log.append_many(Stream.EVENTS, [heartbeat(2)], routine=True)
        thread.join(30.0)
        assert not thread.is_alive(), "a routine commit did not wake a follower of every commit"
    assert got == [[routine], [other], [last]]


def test_without_inotify_a_follower_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit_signal, "_LIBC", None)
    url = f"sqlite:///{tmp_path / 'run.db'}"
    with EmbeddedLog.from_url(url) as follower_log, EmbeddedLog.from_url(url) as writer_log:
        assert follower_log._waiter(Stream.EVENTS) is None
        got: list[object] = []
        thread = _following(follower_log, Stream.EVENTS, got)
        position = writer_log.append(Stream.EVENTS, heartbeat(0))
        thread.join(30.0)
        assert got == [[position]]


@pytest.mark.usefixtures("no_polling")
def test_closing_the_log_ends_a_follow_that_waits_for_a_ring(tmp_path: Path) -> None:
    """The wait is cancelled before its descriptors close (none is closed under a wait)."""
    log = EmbeddedLog.from_url(f"sqlite:///{tmp_path / 'run.db'}")
    got: list[object] = []
    thread = _following(log, Stream.EVENTS, got)
    log.close()
    thread.join(30.0)
    assert not thread.is_alive(), "the follow outlived the log"
    assert got == [f"log {log.url} is closed"]
