"""The contract every log backend keeps, run against each one through ``open_log`` only.

Backends come from the ``log_url`` / ``persistent_log_url`` fixtures in conftest.py; tests that
open the same URL twice (reopen, other processes) use the persistent one.
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as MpEvent

import pytest

from flashrecovery.connectors import Entry, LogConnector, open_log
from flashrecovery.errors import LogError
from flashrecovery.records import (
    Envelope,
    Heartbeat,
    IsolateRank,
    StepCompleted,
    Stream,
    dump_record,
)
from flashrecovery.replay.verify import verify as verify_chains

EVENTS = Stream.EVENTS
DECISIONS = Stream.DECISIONS
WAIT_S = 30.0  # upper bound on any wait for another thread or process: never reached when green
PROMPT_S = 1.0  # "promptly", generous for a loaded 2-core machine; pollers wake within ~20 ms
# Not synchronisation (Events order things): time for a follower to get past its first checks and
# into its wait, so that the append exercises waking up rather than the initial read.
SETTLE_S = 0.2
WRITERS = 4
PER_WRITER = 200

_SPAWN = multiprocessing.get_context("spawn")


def heartbeat(job_id: str, step: int, rank: int = 0) -> Heartbeat:
    return Heartbeat(job_id=job_id, generation=0, source=f"rank:{rank}", rank=rank, step=step,
                     pid=1000 + rank, host="node0")  # fmt: skip


def isolate(job_id: str, caused_by: int) -> IsolateRank:
    return IsolateRank(job_id=job_id, generation=0, source="engine", caused_by=caused_by, rank=1,
                       reason="heartbeat missed")  # fmt: skip


def records_of(entries: list[Entry]) -> list[Envelope | None]:
    return [entry.record for entry in entries]


def assert_strictly_increasing(positions: list[int]) -> None:
    assert all(a < b for a, b in itertools.pairwise(positions)), positions


# ------------------------------------------------------------------ append and read


def test_append_returns_increasing_positions_and_read_returns_each_jobs_records(
    log: LogConnector,
) -> None:
    written: dict[str, list[tuple[int, Heartbeat]]] = {"job-a": [], "job-b": []}
    positions = []
    for step in range(10):
        for job_id in ("job-a", "job-b"):  # interleaved
            record = heartbeat(job_id, step)
            position = log.append(EVENTS, record)
            positions.append(position)
            written[job_id].append((position, record))
    assert_strictly_increasing(positions)

    for job_id, expected in written.items():
        entries = log.read(EVENTS, job_id)
        assert [e.position for e in entries] == [p for p, _ in expected]
        assert records_of(entries) == [r for _, r in expected]
        # Stored as dumped, with the link of its writer's chain (rank:0 on this handle).
        links = [e.record.chain for e in entries if e.record is not None]
        assert [e.raw for e in entries] == [
            dump_record(r.model_copy(update={"chain": link}))
            for (_, r), link in zip(expected, links, strict=True)
        ]
        assert [(link.seq, link.writer.split("/")[0]) for link in links if link] == [
            (seq, "rank:0") for seq in range(10)
        ]
        assert all(e.error is None for e in entries)
    assert log.read(EVENTS, "job-c") == []


def test_a_batch_is_stored_in_order_between_single_appends_and_chained(log: LogConnector) -> None:
    before = log.append(EVENTS, heartbeat("job", 0))
    batch = [heartbeat("job", step, rank=step % 2) for step in range(1, 41)]
    positions = log.append_many(EVENTS, batch)
    after = log.append(EVENTS, heartbeat("job", 41))
    assert_strictly_increasing([before, *positions, after])
    entries = log.read(EVENTS, "job")
    assert [e.position for e in entries] == [before, *positions, after]
    assert records_of(entries)[1:-1] == batch
    assert verify_chains({EVENTS: entries}).ok  # each writer's chain runs through the batch
    assert log.append_many(EVENTS, []) == []
    with pytest.raises(ValueError, match="one job"):
        log.append_many(EVENTS, [heartbeat("job", 42), heartbeat("other", 42)])
    assert len(log.read(EVENTS, "job")) == len(entries)  # the refused batch stored nothing


def test_records_handed_over_without_waiting_are_stored_in_the_writers_order(
    log: LogConnector,
) -> None:
    """append_async and append of one writer interleaved: after flush, every record is there
    once, in call order, and the writer's chain runs through both kinds."""
    written: list[Heartbeat] = []
    for step in range(60):
        record = heartbeat("job", step)
        written.append(record)
        if step % 20 == 19:
            log.append(EVENTS, record)  # a writer that needs its record stored now
        else:
            log.append_async(EVENTS, record)
    log.flush(timeout=WAIT_S)
    entries = log.read(EVENTS, "job")
    assert records_of(entries) == written
    assert all(e.error is None for e in entries)
    assert verify_chains({EVENTS: entries}).ok


def test_close_stores_what_was_handed_over(persistent_log_url: str) -> None:
    records = [heartbeat("job", step) for step in range(50)]
    with open_log(persistent_log_url) as writer:
        for record in records:
            writer.append_async(EVENTS, record)
    with open_log(persistent_log_url) as reader:
        assert records_of(reader.read(EVENTS, "job")) == records
    with pytest.raises(LogError):
        writer.append_async(EVENTS, heartbeat("job", 50))  # closed: refused at once


def test_read_from_position_and_limit(log: LogConnector) -> None:
    records = [heartbeat("job", step) for step in range(8)]
    positions = []
    for step, record in enumerate(records):
        positions.append(log.append(EVENTS, record))
        log.append(EVENTS, heartbeat("other", step))  # makes the job's positions sparse

    assert records_of(log.read(EVENTS, "job", from_position=positions[3])) == records[3:]
    # A position between two of the job's records starts at the next one.
    assert records_of(log.read(EVENTS, "job", from_position=positions[1] + 1)) == records[2:]
    assert records_of(log.read(EVENTS, "job", limit=2)) == records[:2]
    assert records_of(log.read(EVENTS, "job", from_position=positions[2], limit=3)) == records[2:5]
    assert log.read(EVENTS, "job", limit=0) == []
    assert log.read(EVENTS, "job", from_position=positions[-1] + 1) == []
    assert records_of(log.read(EVENTS, "job", from_position=0, limit=100)) == records


def test_events_and_decisions_are_separate_streams(log: LogConnector) -> None:
    event = heartbeat("job", 1)
    event_position = log.append(EVENTS, event)
    decision = isolate("job", caused_by=event_position)
    decision_position = log.append(DECISIONS, decision)
    later_event = StepCompleted(job_id="job", generation=0, source="rank:0", rank=0, step=2,
                                duration_s=0.5)  # fmt: skip
    log.append(EVENTS, later_event)

    assert records_of(log.read(EVENTS, "job")) == [event, later_event]
    decisions = log.read(DECISIONS, "job")
    assert records_of(decisions) == [decision]
    assert decisions[0].position == decision_position
    assert log.follow(DECISIONS, "job", decision_position + 1, timeout=0.05) == []


def test_jobs_lists_every_job_once_sorted(log: LogConnector) -> None:
    assert log.jobs() == []
    log.append(EVENTS, heartbeat("zeta", 0))
    log.append(EVENTS, heartbeat("alpha", 0))
    log.append(EVENTS, heartbeat("zeta", 1))
    log.append(DECISIONS, isolate("mid", caused_by=0))  # a job seen only in decisions
    log.append_raw(EVENTS, "beta", b"garbage")  # a job whose only record is invalid
    assert log.jobs() == ["alpha", "beta", "mid", "zeta"]


# ------------------------------------------------------------------ follow


def test_follow_returns_at_once_when_records_exist(log: LogConnector) -> None:
    first = log.append(EVENTS, heartbeat("job", 0))
    second = log.append(EVENTS, heartbeat("job", 1))
    started = time.monotonic()
    entries = log.follow(EVENTS, "job", first, timeout=WAIT_S)
    assert time.monotonic() - started < PROMPT_S
    assert [e.position for e in entries] == [first, second]
    assert [e.position for e in log.follow(EVENTS, "job", second, timeout=WAIT_S)] == [second]


def test_follow_returns_nothing_after_its_bound_when_no_record_arrives(log: LogConnector) -> None:
    bound = 0.3
    last = log.append(EVENTS, heartbeat("job", 0))  # before from_position: does not count
    log.append(EVENTS, heartbeat("other-job", 0))  # another job: does not count
    log.append(DECISIONS, isolate("job", caused_by=last))  # another stream: does not count
    started = time.monotonic()
    entries = log.follow(EVENTS, "job", last + 1, timeout=bound)
    waited = time.monotonic() - started
    assert entries == []
    assert waited >= bound - 0.01
    assert waited < bound + 2.0


def test_follow_wakes_promptly_when_another_thread_appends(log: LogConnector) -> None:
    start = log.append(EVENTS, heartbeat("job", 0)) + 1
    following = threading.Event()
    result: list[Entry] = []
    returned_at: list[float] = []

    def follower() -> None:
        following.set()
        result.extend(log.follow(EVENTS, "job", start, timeout=WAIT_S))
        returned_at.append(time.monotonic())

    thread = threading.Thread(target=follower, daemon=True)
    thread.start()
    assert following.wait(WAIT_S)
    time.sleep(SETTLE_S)
    log.append(EVENTS, heartbeat("other-job", 0))  # must not end the wait on its own
    record = heartbeat("job", 1)
    appended_at = time.monotonic()
    position = log.append(EVENTS, record)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert [(e.position, e.record) for e in result] == [(position, record)]
    assert returned_at[0] - appended_at < PROMPT_S


def test_a_follower_that_skips_routine_wakes_still_gets_routine_records(
    log: LogConnector,
) -> None:
    """What the engine relies on: routine records (a step's) appended while it waits reach a
    follow with ``wake_on_routine=False`` by the end of its wait at the latest."""
    start = log.append(EVENTS, heartbeat("job", 0)) + 1
    following = threading.Event()
    result: list[Entry] = []

    def follower() -> None:
        following.set()
        result.extend(log.follow(EVENTS, "job", start, timeout=PROMPT_S, wake_on_routine=False))

    thread = threading.Thread(target=follower, daemon=True)
    thread.start()
    assert following.wait(WAIT_S)
    time.sleep(SETTLE_S)
    record = heartbeat("job", 1)
    [position] = log.append_many(EVENTS, [record], routine=True)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert [(e.position, e.record) for e in result] == [(position, record)]


def _append_when_told(url: str, job_id: str, ready: MpEvent, go: MpEvent) -> None:
    """Child process: open the log, say so, then append one heartbeat (stamped now) when told."""
    with open_log(url) as log:
        ready.set()
        if not go.wait(WAIT_S):
            raise TimeoutError("never told to append")
        log.append(EVENTS, heartbeat(job_id, 1, rank=1))


@contextmanager
def running(processes: list[SpawnProcess]) -> Iterator[list[SpawnProcess]]:
    """Start the processes; on the way out wait for them (bounded) and kill any left over."""
    for process in processes:
        process.start()
    try:
        yield processes
    finally:
        for process in processes:
            process.join(WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
            process.close()


def test_follow_wakes_promptly_when_another_process_appends(persistent_log_url: str) -> None:
    ready, go = _SPAWN.Event(), _SPAWN.Event()
    writer = _SPAWN.Process(target=_append_when_told, args=(persistent_log_url, "job", ready, go))
    with open_log(persistent_log_url) as log, running([writer]):
        start = log.append(EVENTS, heartbeat("job", 0)) + 1
        assert ready.wait(WAIT_S)
        following = threading.Event()
        result: list[Entry] = []
        returned_at: list[float] = []

        def follower() -> None:
            following.set()
            result.extend(log.follow(EVENTS, "job", start, timeout=WAIT_S))
            returned_at.append(time.time())  # wall clock: compared with the child's record.ts

        thread = threading.Thread(target=follower, daemon=True)
        thread.start()
        assert following.wait(WAIT_S)
        time.sleep(SETTLE_S)
        go.set()
        thread.join(WAIT_S)
        assert not thread.is_alive()
        writer.join(WAIT_S)
        assert writer.exitcode == 0
    assert len(result) == 1
    record = result[0].record
    assert isinstance(record, Heartbeat)
    assert (record.rank, record.step) == (1, 1)
    assert returned_at[0] - record.ts < PROMPT_S


# ------------------------------------------------------------------ invalid records


def test_garbage_is_flagged_and_valid_records_around_it_still_read(log: LogConnector) -> None:
    before, after = heartbeat("job", 0), heartbeat("job", 1)
    garbage = {
        b"\x00\xffnot json at all": "not JSON",
        b"[1, 2, 3]": "expected a JSON object",
        b'{"schema_version": 99, "type": "heartbeat"}': "schema_version",
        b'{"schema_version": 1, "type": "heartbeat", "job_id": "job"}': "generation",
        b'{"schema_version": 1, "type": "no_such_type", "job_id": "job"}': "type",
        dump_record(isolate("job", caused_by=0)): "type",  # a decision in the events stream
    }
    log.append(EVENTS, before)
    for raw in garbage:
        log.append_raw(EVENTS, "job", raw)
    log.append(EVENTS, after)

    for entries in (log.read(EVENTS, "job"), log.follow(EVENTS, "job", 0, timeout=WAIT_S)):
        assert len(entries) == len(garbage) + 2
        assert_strictly_increasing([e.position for e in entries])
        assert (entries[0].record, entries[-1].record) == (before, after)
        assert entries[0].error is None and entries[-1].error is None
        for entry, (raw, named) in zip(entries[1:-1], garbage.items(), strict=True):
            assert entry.raw == raw
            assert entry.record is None
            assert entry.error is not None and named in entry.error, entry.error


# ------------------------------------------------------------------ persistence


def test_reopen_after_close_sees_everything(persistent_log_url: str) -> None:
    with open_log(persistent_log_url) as log:
        events = {job: [heartbeat(job, step) for step in range(5)] for job in ("b-job", "a-job")}
        event_positions = {job: [log.append(EVENTS, r) for r in rs] for job, rs in events.items()}
        decision = isolate("a-job", caused_by=event_positions["a-job"][0])
        decision_position = log.append(DECISIONS, decision)
        raw_position = log.append_raw(EVENTS, "a-job", b"not a record")
    with open_log(persistent_log_url) as log:
        assert log.jobs() == ["a-job", "b-job"]
        for job, records in events.items():
            entries = log.read(EVENTS, job)
            if job == "a-job":
                assert entries[-1].position == raw_position and entries[-1].record is None
                entries = entries[:-1]
            assert [e.position for e in entries] == event_positions[job]
            assert records_of(entries) == records
        assert [(e.position, e.record) for e in log.read(DECISIONS, "a-job")] == [
            (decision_position, decision)
        ]
        assert log.append(EVENTS, heartbeat("a-job", 5)) > raw_position


# ------------------------------------------------------------------ concurrency


def _append_heartbeats(url: str, job_id: str, writer: int, count: int, go: MpEvent) -> None:
    """Writer process: heartbeats with step = its own sequence number and rank = writer id."""
    with open_log(url) as log:
        if not go.wait(WAIT_S):
            raise TimeoutError("never told to start")
        for step in range(count):
            log.append(EVENTS, heartbeat(job_id, step, rank=writer))


def _follow_until(log: LogConnector, job_id: str, count: int, seen: list[Entry]) -> None:
    """Tail the job's events until ``count`` entries have arrived or WAIT_S has passed."""
    deadline = time.monotonic() + WAIT_S
    position = 0
    while len(seen) < count and time.monotonic() < deadline:
        for entry in log.follow(EVENTS, job_id, position, timeout=0.5):
            position = entry.position + 1
            seen.append(entry)


def assert_each_writer_complete_and_in_order(entries: list[Entry]) -> None:
    assert_strictly_increasing([e.position for e in entries])
    by_writer: dict[int, list[int]] = {}
    for entry in entries:
        assert isinstance(entry.record, Heartbeat), entry.error
        by_writer.setdefault(entry.record.rank, []).append(entry.record.step)
    # No loss, no duplicate, and each writer's records in the order it appended them.
    assert by_writer == {writer: list(range(PER_WRITER)) for writer in range(WRITERS)}
    # Each writer's hash chain holds although the writers appended at the same time.
    report = verify_chains({EVENTS: entries})
    assert report.ok and report.writers == WRITERS and report.unchained == 0, report.breaks


def test_concurrent_writer_threads_with_a_follower(log: LogConnector) -> None:
    go = threading.Event()
    seen: list[Entry] = []
    follower = threading.Thread(target=_follow_until, args=(log, "job", WRITERS * PER_WRITER, seen))

    def write(writer: int) -> None:
        assert go.wait(WAIT_S)
        for step in range(PER_WRITER):
            log.append(EVENTS, heartbeat("job", step, rank=writer))

    writers = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    follower.start()
    for thread in writers:
        thread.start()
    go.set()
    for thread in [*writers, follower]:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert_each_writer_complete_and_in_order(log.read(EVENTS, "job"))
    assert [e.position for e in seen] == [e.position for e in log.read(EVENTS, "job")]


def test_concurrent_writer_processes_with_a_follower(persistent_log_url: str) -> None:
    go = _SPAWN.Event()
    writers = [
        _SPAWN.Process(
            target=_append_heartbeats, args=(persistent_log_url, "job", w, PER_WRITER, go)
        )
        for w in range(WRITERS)
    ]
    seen: list[Entry] = []
    with open_log(persistent_log_url) as log, running(writers):
        follower = threading.Thread(
            target=_follow_until, args=(log, "job", WRITERS * PER_WRITER, seen)
        )
        follower.start()
        go.set()
        follower.join(WAIT_S + 1)
        assert not follower.is_alive()
        for process in writers:
            process.join(WAIT_S)
            assert process.exitcode == 0
        stored = log.read(EVENTS, "job")
    assert_each_writer_complete_and_in_order(stored)
    assert [(e.position, e.raw) for e in seen] == [(e.position, e.raw) for e in stored]
