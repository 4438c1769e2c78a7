"""The agents' meeting store: the end of a job is read from wherever the plan moved it, in time
for its host to see the reader's confirmation before it ends the job."""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from flashrecovery.agent.job import NODES_DONE_WAIT_S
from flashrecovery.agent.meeting import EndWatch, Meeting
from flashrecovery.agent.store import JobStore
from flashrecovery.errors import ConfigError
from flashrecovery.records import AssignSpare, RegroupPlanned, SpawnReplacement
from flashrecovery.trainer_hooks import barrier

TIMEOUT = datetime.timedelta(seconds=10)
PREFIX = "meeting-test-secret"


class _SeenAsking(Meeting):
    """A meeting that tells when the watch first asked for the store it started at."""

    def __init__(self, own: JobStore, first: str) -> None:
        super().__init__(own, first)
        self.first, self.asked_first = first, threading.Event()

    def keys(self) -> dist.Store:
        if self.endpoint == self.first:
            self.asked_first.set()
        return super().keys()


@pytest.fixture
def gone_endpoint() -> str:
    """Where a store was: a port that refuses connections now (its host's process is gone)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    return f"127.0.0.1:{port}"


@pytest.fixture
def frozen_endpoint() -> Iterator[str]:
    """Where a store's host froze (SIGSTOP, or a process in the middle of dying): its socket
    still takes connections, nobody answers on them."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture(params=["gone", "frozen"])
def lost_endpoint(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_endpoint"))


@pytest.fixture
def stores() -> Iterator[tuple[JobStore, JobStore]]:
    yield JobStore.open(TIMEOUT, prefix=PREFIX), JobStore.open(TIMEOUT, prefix=PREFIX)


def test_the_end_is_read_from_the_store_a_plan_moved_the_meeting_to_while_the_old_one_is_lost(
    lost_endpoint: str, stores: tuple[JobStore, JobStore]
) -> None:
    own, new_host = stores
    meeting = _SeenAsking(own, lost_endpoint)
    end = EndWatch(meeting, lambda: 1)
    try:
        assert meeting.asked_first.wait(TIMEOUT.total_seconds())
        plan = RegroupPlanned(
            job_id="j", generation=1, source="engine", caused_by=1, members=[0, 1], replaced=[0],
            store=new_host.endpoint,
        )  # fmt: skip
        assert meeting.follow(plan)
        key = barrier.name(1, "done")
        new_host.keys.add(f"{key}/arrived", 1)  # one member arrived, the other passes it
        assert barrier.wait(new_host.keys, key, 2, TIMEOUT)
        # The new store's host waits this long for this agent's word that it saw the end.
        assert end.passed.wait(NODES_DONE_WAIT_S), "the watch still waits on the lost store"
    finally:
        end.close()


def test_a_gone_store_is_away_at_once_and_says_where(gone_endpoint: str) -> None:
    own = JobStore.open(TIMEOUT, prefix=PREFIX)
    with pytest.raises(ConfigError, match=f"meeting store at {gone_endpoint} is away"):
        Meeting(own, gone_endpoint).keys()


def test_a_frozen_store_is_given_up_on_within_the_connect_timeout(frozen_endpoint: str) -> None:
    own = JobStore.open(TIMEOUT, prefix=PREFIX)
    with pytest.raises(ConfigError, match=f"meeting store at {frozen_endpoint} does not answer"):
        Meeting(own, frozen_endpoint).keys()


def test_an_assigned_spare_moves_the_meeting_before_the_plan_does(
    gone_endpoint: str, stores: tuple[JobStore, JobStore]
) -> None:
    """The agent starts a spare in place of one the incident assigned before its plan arrives:
    the new spare must meet on the store the assignment names, not on the node just lost."""
    own, new_host = stores
    meeting = Meeting(own, gone_endpoint)
    envelope = {"job_id": "j", "generation": 1, "source": "engine", "caused_by": 1}
    assign = AssignSpare(**envelope, rank=0, spare_id=7, node=2, store=new_host.endpoint)
    assert meeting.follow(assign) and meeting.endpoint == new_host.endpoint
    plan = RegroupPlanned(**envelope, members=[0, 1], replaced=[0], store=new_host.endpoint)
    assert not meeting.follow(plan)  # already there
    assert not meeting.follow(SpawnReplacement(**envelope, rank=1, node=1))  # names none
    assert meeting.endpoint == new_host.endpoint
