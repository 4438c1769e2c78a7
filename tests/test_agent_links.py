"""A node's processes and their agent (agent/links.py, trainer_hooks/agent_link.py,
agent/nodedir.py): real sockets, a real sqlite log, real processes killed with real signals."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashrecovery.agent.links import NICE, ProcessLinks
from flashrecovery.agent.nodedir import NodeDir, remove_stale
from flashrecovery.connectors import LogConnector, commit_signal, open_log
from flashrecovery.records import CollectiveError, RegroupPlanned, StepCompleted, Stream
from flashrecovery.trainer_hooks.agent_link import AgentLink

JOB = "links"
WAIT_S = 10.0


def step(rank: int, step: int) -> StepCompleted:
    return StepCompleted(
        job_id=JOB, generation=0, source=f"rank:{rank}", rank=rank, step=step, duration_s=0.1
    )


def regroup(generation: int) -> RegroupPlanned:
    return RegroupPlanned(
        job_id=JOB,
        generation=generation,
        source="engine",
        record_id=f"d{generation}",
        ts=1_800_000_000.0 + generation,
        caused_by=generation,
        members=[0, 1],
        replaced=[1],
    )


@pytest.fixture
def log(tmp_path: Path) -> Iterator[LogConnector]:
    with open_log(f"sqlite:///{tmp_path / 'log.db'}") as connector:
        yield connector


@pytest.fixture
def links(tmp_path: Path, log: LogConnector) -> Iterator[ProcessLinks]:
    directory = tmp_path / "node"
    directory.mkdir()
    links = ProcessLinks(directory, log, patience_s=5.0)
    yield links
    links.close(5.0)


def steps_in(log: LogConnector) -> list[tuple[int, int]]:
    return [
        (e.record.rank, e.record.step)
        for e in log.read(Stream.EVENTS, JOB)
        if isinstance(e.record, StepCompleted)
    ]


def test_records_handed_over_are_written_in_batches_in_order_and_acknowledged(
    links: ProcessLinks, log: LogConnector
) -> None:
    ranks = [AgentLink(links.path) for _ in range(4)]
    try:
        for s in range(5):
            numbers = [link.hand(step(rank, s)) for rank, link in enumerate(ranks)]
            for link, number in zip(ranks, numbers, strict=True):
                assert link.wait_logged(number, WAIT_S, lambda: False)
    finally:
        for link in ranks:
            link.close()
    written = steps_in(log)
    assert sorted(written) == [(r, s) for r in range(4) for s in range(5)]
    for rank in range(4):  # each process's records in the order it handed them over
        assert [s for r, s in written if r == rank] == list(range(5))
    assert links.batches < len(written)  # a step's records of several ranks in one write


def test_the_record_threads_yield_to_the_ranks_the_callers_thread_keeps_its_priority(
    links: ProcessLinks, log: LogConnector
) -> None:
    rank = AgentLink(links.path)
    try:
        assert rank.wait_logged(rank.hand(step(0, 0)), WAIT_S, lambda: False)  # reader started
        nice = {
            thread.name: os.getpriority(os.PRIO_PROCESS, thread.native_id)
            for thread in threading.enumerate()
            if thread.native_id is not None
        }
    finally:
        rank.close()
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    record_threads = {
        name: value
        for name, value in nice.items()
        if name.startswith(("link-accept", "link-writer", "link-in-"))
    }
    assert {"link-accept", "link-writer", f"link-in-{os.getpid()}"} <= set(record_threads)
    assert set(record_threads.values()) == {min(own + NICE, 19)}
    assert nice["MainThread"] == own


def test_steps_alone_are_routine_anything_else_rings_the_urgent_signal(
    tmp_path: Path, links: ProcessLinks, log: LogConnector
) -> None:
    """The agent's engine waits for the urgent signal only: for every step that was a wake-up
    on the cores the ranks train on, for records nothing acts on at once."""
    waiters = {
        urgent: commit_signal.Waiter.open(tmp_path / "log.db", Stream.EVENTS, urgent)
        for urgent in (False, True)
    }
    ranks = [AgentLink(links.path) for _ in range(2)]

    def hand_all(records: list[StepCompleted | CollectiveError]) -> dict[bool, bool]:
        """Hand each rank its record, wait until all are in the log: which signals rang?"""
        for waiter in waiters.values():
            assert waiter is not None
            waiter.clear()
        numbers = [link.hand(record) for link, record in zip(ranks, records, strict=True)]
        for link, number in zip(ranks, numbers, strict=True):
            assert link.wait_logged(number, WAIT_S, lambda: False)
        return {
            urgent: bool(select.select([waiter._fd], [], [], 0)[0])
            for urgent, waiter in waiters.items()
            if waiter is not None
        }

    failed = [
        CollectiveError(
            job_id=JOB, generation=0, source=f"rank:{r}", rank=r, step=3, error="peer gone"
        )
        for r in range(2)
    ]
    try:
        rung = [hand_all([step(0, s), step(1, s)]) for s in range(3)]
        rung.append(hand_all(failed))
    finally:
        for link in ranks:
            link.close()
        for waiter in waiters.values():
            if waiter is not None:
                waiter.close()
    steps_only, error = {False: True, True: False}, {False: True, True: True}
    assert rung == [steps_only, steps_only, steps_only, error]
    assert len(steps_in(log)) == 6  # as durable as ever: every step is in the log


def test_a_process_killed_right_after_handing_over_still_has_its_records_logged(
    links: ProcessLinks, log: LogConnector
) -> None:
    child = textwrap.dedent(
        f"""
        import os, signal
        from flashrecovery.records import StepCompleted
        from flashrecovery.trainer_hooks.agent_link import AgentLink
        link = AgentLink({links.path!r})
        for s in range(50):
            link.hand(StepCompleted(job_id={JOB!r}, generation=0, source="rank:1", rank=1,
                                    step=s, duration_s=0.1))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", child])
    assert process.wait(60) == -signal.SIGKILL
    assert links.drain(process.pid, WAIT_S)  # what the agent does before reporting the exit
    assert steps_in(log) == [(1, s) for s in range(50)]


def test_a_dead_process_is_drained_even_while_a_forked_child_holds_its_connection(
    links: ProcessLinks, log: LogConnector
) -> None:
    """A DataLoader worker forked by a rank keeps a copy of its connection open after the rank
    died: its exit must not be reported late for it."""
    child = textwrap.dedent(
        f"""
        import os, signal, time
        from flashrecovery.records import StepCompleted
        from flashrecovery.trainer_hooks.agent_link import AgentLink
        link = AgentLink({links.path!r})
        link.hand(StepCompleted(job_id={JOB!r}, generation=0, source="rank:2", rank=2, step=0,
                                duration_s=0.1))
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        assert process.wait(60) == -signal.SIGKILL
        started = time.monotonic()
        assert links.drain(process.pid, WAIT_S)
        assert time.monotonic() - started < WAIT_S / 2
        assert steps_in(log) == [(2, 0)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the forked child


def test_decisions_reach_every_process_even_one_that_connects_later(links: ProcessLinks) -> None:
    early = AgentLink(links.path)
    try:
        links.relay(regroup(1))
        assert early.poll_decisions(WAIT_S) == [regroup(1)]
        late = AgentLink(links.path)
        try:
            assert late.poll_decisions(WAIT_S) == [regroup(1)]  # what came before it joined
            links.relay(regroup(2))
            assert early.poll_decisions(WAIT_S) == [regroup(2)]
            assert late.poll_decisions(WAIT_S) == [regroup(2)]
        finally:
            late.close()
    finally:
        early.close()


def test_a_process_learns_that_its_agent_is_gone(tmp_path: Path, log: LogConnector) -> None:
    links = ProcessLinks(tmp_path, log, patience_s=5.0)
    link = AgentLink(links.path)
    try:
        number = link.hand(step(0, 0))
        assert link.wait_logged(number, WAIT_S, lambda: False)
        links.close(0.5)  # its process still connected: the agent waits that long for its end
        assert link.poll_decisions(WAIT_S) == []
        assert link.closed
        # a wait for a record the agent never wrote gives up rather than hang
        assert not link.wait_logged(number + 1, WAIT_S, lambda: False)
    finally:
        link.close()


def test_a_wait_for_the_log_gives_up_when_told(links: ProcessLinks) -> None:
    link = AgentLink(links.path)
    try:
        assert not link.wait_logged(1, WAIT_S, lambda: True)  # nothing handed: never logged
    finally:
        link.close()


def test_a_killed_agents_node_directory_is_removed_by_the_next_agent() -> None:
    child = "from flashrecovery.agent.nodedir import NodeDir; print(NodeDir().path, flush=True)"
    process = subprocess.Popen(
        [sys.executable, "-c", f"{child}; import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    stale = Path(process.stdout.readline().strip())
    assert stale.is_dir() and oct(stale.stat().st_mode & 0o777) == "0o700"
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    process.stdout.close()
    assert stale.is_dir()  # nothing removed it
    node_dir = NodeDir()
    try:
        assert not stale.exists()
        assert node_dir.path.is_dir()
        assert node_dir.path not in remove_stale(node_dir.path.parent)  # a live agent's stays
    finally:
        node_dir.close()
    assert not node_dir.path.exists()
