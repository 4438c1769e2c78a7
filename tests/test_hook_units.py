"""The hook's store vote and state transfer, on a real TCPStore and real gloo groups in one
process (two threads play two ranks)."""

from __future__ import annotations

import datetime
import os
import random
import threading
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from flashrecovery.agent.store import JobStore
from flashrecovery.trainer_hooks import barrier, groups, rng, transfer, vote

pytestmark = pytest.mark.timeout(60)
TIMEOUT = datetime.timedelta(seconds=10)


@pytest.fixture
def job_store() -> JobStore:
    return JobStore.open(TIMEOUT)


@pytest.fixture
def store(job_store: JobStore) -> dist.Store:
    """The job's keys, as the agent and the ranks see them."""
    return job_store.keys


def test_vote_commits_only_when_every_member_voted(store: dist.Store) -> None:
    key = vote.vote_key(0, 5)
    assert vote.cast(store, key, 1, 3) is None
    assert vote.cast(store, key, 0, 3) is None
    assert vote.cast(store, key, 2, 3) is vote.Verdict.COMMITTED
    assert vote.close(store, key, 3) is vote.Verdict.COMMITTED  # a full vote can't be closed
    assert vote.wait(store, key, datetime.timedelta(seconds=1)) is vote.Verdict.COMMITTED


def test_a_closed_vote_aborts_for_everyone(store: dist.Store) -> None:
    key = vote.vote_key(1, 5)
    assert vote.cast(store, key, 0, 3) is None
    assert vote.close(store, key, 3) is vote.Verdict.ABORTED
    assert vote.cast(store, key, 1, 3) is vote.Verdict.ABORTED  # can't vote on a closed vote
    assert vote.wait(store, key, datetime.timedelta(seconds=1)) is vote.Verdict.ABORTED
    assert vote.close(store, vote.vote_key(1, 6), 3) is vote.Verdict.ABORTED  # nobody voted yet


def test_a_superseded_generation_releases_its_barrier(store: dist.Store) -> None:
    timeout = datetime.timedelta(seconds=5)
    barrier.supersede(store, barrier.name(3, "members"))
    assert barrier.wait(store, barrier.name(3, "members"), 2, timeout) is False
    assert barrier.wait(store, barrier.name(4, "members"), 1, timeout) is True
    barrier.supersede(store, barrier.name(4, "members"))  # too late: it passed
    assert barrier.wait(store, barrier.name(4, "members"), 1, timeout) is True


def test_a_group_that_lost_a_member_while_forming_is_given_up_when_superseded(
    job_store: JobStore,
) -> None:
    """Rank 1 passed the barrier and died before joining the group: rank 0 waits in the
    rendezvous (other threads run meanwhile: the heartbeats go on) until a newer generation is
    planned, then gives up at once instead of after the collective timeout."""
    client = groups.connect_store("127.0.0.1", job_store.port, job_store.prefix)
    newer_plan = threading.Event()
    timer = threading.Timer(0.3, newer_plan.set)  # a Python thread: it needs the GIL to run
    timer.start()
    with pytest.raises(dist.DistStoreError, match="generation 7 was superseded"):
        groups.build(client, 7, 0, 2, newer_plan.is_set)
    timer.join()


def _two_ranks(job_store: JobStore, work: Any) -> list[Any]:
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        # One blocking waiter per client.
        client = groups.connect_store("127.0.0.1", job_store.port, job_store.prefix)
        group = groups.build(client, 0, r, 2, lambda: False)
        results[r] = work(r, group)
        groups.drop(group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_transfer_moves_tensors_and_structure_exactly(job_store: JobStore) -> None:
    random.seed(7)
    state = {
        "model": {"w": torch.randn(4, 3), "steps": torch.tensor(9), "mask": torch.ones(2) > 0},
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(5, dtype=torch.float64)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "rng": rng.capture(),
        "committed_step": 41,
    }

    def work(r: int, group: groups.Group) -> Any:
        if r == 0:
            return transfer.send(group, 1, state)
        return transfer.recv(group, 0)

    sent, (received, size) = _two_ranks(job_store, work)
    assert sent == size > 0
    assert received["committed_step"] == 41
    assert received["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for got, want in [
        (received["model"]["w"], state["model"]["w"]),
        (received["model"]["steps"], state["model"]["steps"]),
        (received["model"]["mask"], state["model"]["mask"]),
        (received["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]),
        (received["rng"]["torch"], state["rng"]["torch"]),
    ]:
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert received["rng"]["python"] == state["rng"]["python"]


def listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_the_job_store_and_gloo_listen_on_loopback_only(
    job_store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = listening(os.getpid())
    assert ("127.0.0.1", job_store.port) in before  # torch alone would bind every address
    for name, value in job_store.environment().items():
        monkeypatch.setenv(name, value)
    opened = _two_ranks(job_store, lambda r, group: listening(os.getpid()))
    gloo = set().union(*opened) - before
    assert gloo and {ip for ip, _ in gloo} <= {"127.0.0.1", "::1"}


def test_a_client_without_the_job_secret_cannot_vote(job_store: JobStore) -> None:
    """It reaches the port, writes a full vote and its verdict under the public key names:
    the job's vote does not see them."""
    intruder = dist.TCPStore("127.0.0.1", job_store.port, is_master=False, timeout=TIMEOUT)
    key = vote.vote_key(0, 5)
    intruder.set(key, "0,1,2")
    intruder.set(f"{key}/verdict", vote.Verdict.COMMITTED.value)
    assert vote.cast(job_store.keys, key, 0, 3) is None  # still waiting for ranks 1 and 2
    assert vote.close(job_store.keys, key, 3) is vote.Verdict.ABORTED
