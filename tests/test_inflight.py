"""A collective held up by a peer stuck in its own code is left behind once a newer generation
is planned (trainer_hooks/inflight.py): real gloo groups, two ranks in two threads."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashrecovery.errors import Superseded
from flashrecovery.trainer_hooks import inflight
from flashrecovery.trainer_hooks.groups import LazyGloo, Rendezvous

TIMEOUT = datetime.timedelta(seconds=30)


def two_groups() -> list[dist.ProcessGroupGloo]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups: list[dist.ProcessGroupGloo | None] = [None, None]

    def build(rank: int) -> None:
        # Through groups.Rendezvous: its waits release the GIL, which gloo's own would hold
        # while the other thread has yet to publish its address.
        rendezvous = Rendezvous(dist.PrefixStore("g/", store), lambda: False, "test")
        groups[rank] = dist.ProcessGroupGloo(rendezvous, rank, 2, TIMEOUT)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(g is not None for g in groups)
    return [g for g in groups if g is not None]


COLLECTIVES: dict[str, Callable[[dist.ProcessGroupGloo], dist.Work]] = {
    "all-reduce": lambda group: group.allreduce([torch.ones(4)]),
    # FSDP2's reduce-scatter: gloo gives its work no future, a thread waits on it instead
    "reduce-scatter": lambda group: group._reduce_scatter_base(torch.zeros(2), torch.ones(4)),
}


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_a_wait_gives_up_once_superseded_and_its_group_is_kept_until_the_work_ends(
    collective: str,
) -> None:
    waiting, stuck = two_groups()
    planned = threading.Event()
    threading.Timer(0.3, planned.set).start()
    work = COLLECTIVES[collective](waiting)
    started = time.monotonic()
    with pytest.raises(Superseded):
        inflight.wait(work, waiting, planned.is_set)  # the peer never joins the sum
    assert time.monotonic() - started < 5, "the wait outlived the newer plan"
    inflight.release_finished()
    [(group, ended)] = inflight._left_behind
    assert group is waiting and not ended.is_set()  # still in flight: kept
    COLLECTIVES[collective](stuck).wait()  # the peer comes back: the collective ends
    work.wait()
    assert ended.wait(5)
    inflight.release_finished()
    assert inflight._left_behind == []


def test_a_wait_that_ends_returns_and_leaves_nothing_behind() -> None:
    left, right = two_groups()
    tensors = [torch.ones(4)], [torch.full((4,), 2.0)]
    other = right.allreduce(tensors[1])
    inflight.wait(left.allreduce(tensors[0]), left, lambda: False)
    other.wait()
    assert torch.equal(tensors[0][0], torch.full((4,), 3.0))
    assert inflight._left_behind == []


class _Ended(dist.Work):
    """A collective that had ended before it was waited for (well, or with ``error``)."""

    def __init__(self, error: str | None = None) -> None:
        super().__init__()
        self._error = error

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: object = None) -> bool:
        if self._error is not None:
            raise RuntimeError(self._error)
        return True

    def get_future(self) -> torch.futures.Future[object]:
        raise AssertionError("an ended collective was watched")


def test_a_collective_that_ended_is_waited_for_without_a_watch() -> None:
    """FSDP2 waits for most collectives after they ended: no callback on gloo's thread, no
    event, no thread hand-off then, and its error is raised as it is."""
    inflight.wait(_Ended(), object(), lambda: pytest.fail("a plan was looked for"))
    with pytest.raises(RuntimeError, match="peer lost"):
        inflight.wait(_Ended("peer lost"), object(), lambda: False)
    assert inflight._left_behind == []


@pytest.mark.parametrize("planned_first", [False, True])
def test_a_collective_future_fails_when_poked_about_a_newer_plan_not_by_polling(
    planned_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDP's reducer waits on the future: the watcher's own look is a minute away here, so only
    the poke (or, for a plan that came first, the look at hand-out) can fail it in time."""
    monkeypatch.setattr(inflight, "IDLE_LOOK_S", 60.0)
    monkeypatch.setattr(inflight, "_watcher", inflight._Watcher())
    waiting, stuck = two_groups()
    planned = threading.Event()
    if planned_first:
        planned.set()
    work = waiting.allreduce([torch.ones(4)])
    future = inflight.future(work, waiting, planned.is_set)  # the peer never joins the sum
    started = time.monotonic()
    if not planned_first:
        assert not future.done()
        planned.set()
        inflight.poke()
    with pytest.raises(Superseded):
        future.wait()
    assert time.monotonic() - started < 5, "the future outlived the newer plan"
    [(group, ended)] = inflight._left_behind
    assert group is waiting
    stuck.allreduce([torch.ones(4)]).wait()  # the peer comes back: the collective ends
    work.wait()
    assert ended.wait(5)
    inflight.release_finished()
    assert inflight._left_behind == []


def test_a_collective_future_that_ends_lets_go_of_its_group() -> None:
    """The watcher holds a pending collective (and so its group) only while it is in flight: a
    group held until the interpreter's teardown aborted a rank at exit ("terminate called
    without an active exception")."""
    left, right = two_groups()
    other = right.allreduce([torch.ones(4)])
    future = inflight.future(left.allreduce([torch.ones(4)]), left, lambda: False)
    other.wait()
    future.wait()
    assert inflight._watcher._pending == []


GROUP_DROPPED_WHILE_IN_FLIGHT = """
import gc, sys, torch
sys.path.insert(0, {tests!r})
from test_inflight import two_groups
from flashrecovery.trainer_hooks import inflight

left, right = two_groups()
future = inflight.future(left.allreduce([torch.ones(4)]), left, lambda: False)
del left  # the pending collective holds the last reference to its group now
gc.collect()
right.allreduce([torch.ones(4)]).wait()  # the sum ends: settle runs on a gloo thread
future.wait()
inflight.release_finished()  # here, in this thread, the group goes
assert inflight._settled == []
print("ok")
"""


def test_a_group_whose_last_reference_a_settled_collective_held_is_dropped_safely() -> None:
    """Dropped on its own gloo thread (the done callback's), a group's destructor joins that
    thread and the process aborts; the group is let go of in a thread of the process's own."""
    script = GROUP_DROPPED_WHILE_IN_FLIGHT.format(tests=str(Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_a_send_and_its_recv_are_waited_for_once_and_not_bounded_by_the_connect_timeout() -> None:
    """A pipeline stage's send and its neighbour's recv (gloo: no future, a thread waits):
    waited for a second time, a gloo send or recv waits for a message that never comes and
    closes the pair; waited for with no bound, it gives up at the group's connect timeout,
    here a fifth of a second, while the receiver comes later than that, twice."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    left, right = (
        LazyGloo(dist.PrefixStore("p2p/", store), rank, 2, datetime.timedelta(seconds=1))
        for rank in (0, 1)
    )
    for message in (1.0, 2.0):
        received = torch.zeros(4)

        def receive_late(into: torch.Tensor) -> None:
            time.sleep(0.6)
            inflight.wait(right.recv([into], 0, 0), right, lambda: False)

        receiver = threading.Thread(target=receive_late, args=(received,))
        receiver.start()
        inflight.wait(left.send([torch.full((4,), message)], 1, 0), left, lambda: False)
        receiver.join(30)
        assert torch.equal(received, torch.full((4,), message))
    assert inflight._left_behind == []


def _pair(store: dist.Store, prefix: str) -> tuple[LazyGloo, LazyGloo]:
    left, right = (
        LazyGloo(dist.PrefixStore(prefix, store), rank, 2, datetime.timedelta(seconds=5))
        for rank in (0, 1)
    )
    return left, right


def _exchange(left: LazyGloo, right: LazyGloo, message: float, tag: int = 0) -> torch.Tensor:
    """``message`` from left to right, each side waited for through ``inflight.wait``."""
    received = torch.zeros(4)
    receiver = threading.Thread(
        target=lambda: inflight.wait(right.recv([received], 0, tag), right, lambda: False)
    )
    receiver.start()
    inflight.wait(left.send([torch.full((4,), message)], 1, tag), left, lambda: False)
    receiver.join(30)
    return received


def test_sends_and_recvs_go_on_while_a_recv_is_left_behind() -> None:
    """The threads that wait for works without a future are kept from one work to the next: one
    held by a recv left behind (its sender stuck) is not counted on, the next works get
    another."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    left, right = _pair(store, "behind/")
    _exchange(left, right, 0.0)  # connected (a pair connects on its first use, from both ends)
    stuck = right.recv([torch.zeros(4)], 0, 7)
    planned = threading.Event()
    threading.Timer(0.2, planned.set).start()
    with pytest.raises(Superseded):
        inflight.wait(stuck, right, planned.is_set)
    for message in (1.0, 2.0, 3.0):
        assert torch.equal(_exchange(left, right, message), torch.full((4,), message))
    inflight.release_finished()
    [(group, ended)] = inflight._left_behind
    assert group is right and not ended.is_set()
    left.send([torch.ones(4)], 1, 7).wait()  # the stuck sender comes back
    assert ended.wait(10)
    inflight.release_finished()
    assert inflight._left_behind == []


def test_a_forked_child_waits_for_sends_and_recvs() -> None:
    """A rank is forked from the fork server: it holds none of its parent's threads, so it
    must not count on the parent's waiting threads (it would wait for ever)."""
    script = f"""
import datetime, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_inflight import _exchange, _pair

def exchanged(prefix):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return torch.equal(_exchange(*_pair(store, prefix), 5.0), torch.full((4,), 5.0))

assert exchanged("parent/")  # the parent's waiting threads are started
child = os.fork()
if child == 0:
    os._exit(0 if exchanged("child/") else 3)
_, status = os.waitpid(child, 0)
print("ok" if status == 0 else f"child: {{status}}")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
