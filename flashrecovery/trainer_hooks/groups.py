"""Process groups per generation: generation g's gloo group lives under ``gen/{g}/`` of the
agent's store, so a new generation never meets the keys of an old one. Every key of the job
lives under its secret prefix (agent/store.py).

A group connects lazily: building it only publishes this rank's address and waits for nobody;
a pair of ranks connects on first use. Forming a generation whose steps the hook reduces
connects the pairs every step uses (each rank's two ring neighbours: gloo's all-reduce is a
ring), and a restore connects each donor with its recipients before the state moves (with the
user's own DDP or FSDP2 only they have a hook's group at all), so a rank waits for the peers it
talks to, never for the whole world, and forming costs the same at any world size.

Every wait for a peer is bounded without leaving an operation behind: the wait for a peer to
arrive is a supersedable store wait in Python, and gloo's own wait for a connection is bounded
by its connect timeout (short), while collectives keep the long ``COLLECTIVE_TIMEOUT``. A
group is only dropped once nothing of it is in flight, so dropping it never waits on a peer.

Dropping a group must close its connections at once: a peer still blocked in a collective of
the old generation then fails in milliseconds instead of waiting for the collective timeout.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist

from flashrecovery.trainer_hooks import gloo_loop

# Bounds every collective and the rendezvous of a new group; a hung peer is found earlier by
# the heartbeat detector and SIGKILLed, which breaks its peers' collectives at once.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
RENDEZVOUS_SLICE = datetime.timedelta(seconds=0.1)  # how soon a lost peer's supersession shows
# The protocol's own store clients (the vote, the barriers): an operation that names no bound
# gives up after this, so a store whose host is cut off costs seconds, not a collective timeout.
STORE_OP_TIMEOUT = datetime.timedelta(seconds=5)
WAIT_SLICE = datetime.timedelta(seconds=0.5)  # a wait for a peer looks this often for a newer plan
# How long gloo waits for a pair to connect once both ends are known to be there: a peer lost in
# between is given up on after this long (about twice the default heartbeat timeout). gloo's tcp
# pair waits five times the timeout it was built with for a first connection.
CONNECT_TIMEOUT = datetime.timedelta(seconds=6)
_FIRST_CONNECT_FACTOR = 5
HANDSHAKE_TAG = 1 << 30  # the connecting handshake's messages (transfer.py's tags are small)


class Group(Protocol):
    """What the hook uses of a gloo group (torch's stubs omit these methods on backends)."""

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> dist.Work: ...

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int) -> dist.Work: ...

    def shutdown(self) -> None: ...


def job_keys(prefix: str, store: dist.Store) -> dist.Store:
    """The job's view of the store: every key under its secret prefix."""
    return dist.PrefixStore(f"{prefix}/", store)


def connect_store(
    endpoint: str, prefix: str, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT
) -> dist.Store:
    """A client of an agent's store at ``endpoint`` ("host:port"), seeing the job's keys; each
    thread that blocks on the store gets its own. ``timeout`` bounds each of its operations
    that names none (a host cut off answers nothing: the client must not wait for ever)."""
    host, _, port = endpoint.rpartition(":")
    client = dist.TCPStore(
        host, int(port), is_master=False, wait_for_workers=False, timeout=timeout
    )
    return job_keys(prefix, client)


class Rendezvous(dist.Store):
    """The store a new group's rendezvous goes through. gloo waits for every peer inside its
    constructor while holding the GIL, which would silence this process's heartbeats for as long
    as a lost peer is awaited; here every wait is a loop of short store waits (which release the
    GIL) that gives up as soon as ``superseded()`` holds: a newer generation is planned."""

    def __init__(self, inner: dist.Store, superseded: Callable[[], bool], what: str) -> None:
        super().__init__()
        self._inner = inner
        self._superseded = superseded
        self._what = what

    def set(self, key: str, value: str) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.within_slice(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"{self._what}: {keys} not set within {timeout}")

    def within_slice(self, keys: list[str]) -> bool:
        """Whether ``keys`` are set within one short wait; raises once a newer generation is
        planned (a peer that arrived is never given up on: connect() relies on it)."""
        try:
            self._inner.wait(keys, RENDEZVOUS_SLICE)
            return True
        except dist.DistStoreError:
            if self._superseded():
                raise dist.DistStoreError(
                    f"{self._what} was superseded while its group formed"
                ) from None
            return False


class LazyGloo:
    """A gloo group whose pairs connect on first use (its own lazily connecting device), and
    that lets go of that device without hanging on its event loop (gloo_loop.py): drop the
    last reference only once nothing of it is in flight (inflight.py keeps a group whose work
    was left behind until the work ends). A pair's first connect is bounded by
    ``connect_timeout`` (default ``CONNECT_TIMEOUT``), collectives by ``COLLECTIVE_TIMEOUT``.
    A pair whose connect completes after its wait gave up ends the process (an assertion in
    gloo's event loop), so a short bound is only for pairs both ends use at once (connect());
    pairs that connect on a user's collective, whose peer may still be restoring its state,
    get the collective's. Gloo listens on the interface(s) GLOO_SOCKET_IFNAME names
    (loopback: agent/store.py), else on the hostname's address. ``store`` must stay usable as
    long as the group: a pair reads its peer's address there when it first connects."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        connect_timeout: datetime.timedelta | None = None,
    ) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not stubbed
        options._timeout = (connect_timeout or CONNECT_TIMEOUT) / _FIRST_CONNECT_FACTOR
        interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
        options._devices, self._polls = gloo_loop.created_with_polls(
            lambda: (
                [
                    dist.ProcessGroupGloo.create_device(interface=interface, lazy_init=True)
                    for interface in interfaces
                ]
                or [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]
            )
        )
        self.backend = dist.ProcessGroupGloo(store, rank, size, options)
        self.backend.set_timeout(COLLECTIVE_TIMEOUT)
        self._backend = cast(Group, self.backend)  # torch's stubs omit send and recv

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> dist.Work:
        return self._backend.allreduce(tensors)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._backend.send(tensors, dst, tag)

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._backend.recv(tensors, src, tag)

    def shutdown(self) -> None:
        self._backend.shutdown()

    def __del__(self) -> None:
        gloo_loop.quiesce(self._polls)


def connect(group: Group, arrivals: Rendezvous, peers: Iterable[int]) -> None:
    """Connect this rank's pairs with ``peers`` (members that call ``connect`` with this rank
    among theirs): exchange one element with each as soon as it has arrived (it does the same
    as soon as it sees this rank's arrival). The arrivals are looked at in turn, one short wait
    each, in this thread alone: a peer that never comes holds up no other, and no waiter of this
    process keeps another from the store client (a lock that a looping waiter can take again
    and again). A newer plan gives up on a peer before anything is posted to gloo for it.
    Nothing is abandoned: every exchange started is waited for, and each ends at the latest
    when a lost peer's pair gives up connecting (``CONNECT_TIMEOUT``) or a peer that gave up
    drops its group (its sockets close)."""
    waiting = collections.deque(sorted(set(peers)))
    started: list[tuple[dist.Work, dist.Work]] = []
    errors: list[RuntimeError] = []
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    try:
        while waiting:
            peer = waiting.popleft()
            if arrivals.within_slice([_arrived(peer)]):
                sent = group.send([torch.zeros(1)], peer, HANDSHAKE_TAG)
                started.append((sent, group.recv([torch.zeros(1)], peer, HANDSHAKE_TAG)))
            elif time.monotonic() > deadline:
                raise dist.DistStoreError(f"rank {peer} did not arrive in {COLLECTIVE_TIMEOUT}")
            else:
                waiting.append(peer)
    finally:
        for works in started:
            for work in reversed(works):
                try:
                    work.wait()
                except RuntimeError as exc:  # gloo's: the peer was lost or gave up
                    errors.append(exc)
    if errors:
        raise errors[0]


def _arrived(rank: int) -> str:
    return f"arrived/{rank}"


def ring_neighbours(rank: int, size: int) -> set[int]:
    """The peers a ring all-reduce talks to."""
    return {(rank - 1) % size, (rank + 1) % size} - {rank}


def build(
    store: dist.Store,
    generation: int,
    rank: int,
    world_size: int,
    superseded: Callable[[], bool],
    pairs: dist.Store | None = None,
    peers: Iterable[int] | None = None,
) -> Group:
    """Generation ``generation``'s gloo group under ``gen/{g}/``, connected to ``peers`` (by
    default this rank's ring neighbours); no other member is waited for. A peer that never
    arrives is given up on once ``superseded()`` says a newer generation is planned. ``pairs``
    is the store client gloo reads peers' addresses through later, from its own threads
    (default ``store``)."""
    prefixed = dist.PrefixStore(f"gen/{generation}/", store if pairs is None else pairs)
    group = LazyGloo(prefixed, rank, world_size)
    arrivals = _arrivals(store, generation, superseded)
    arrivals.set(_arrived(rank), "1")  # gloo published this rank's address: peers may connect
    connect(group, arrivals, ring_neighbours(rank, world_size) if peers is None else peers)
    return group


def connect_peers(
    group: Group,
    store: dist.Store,
    generation: int,
    peers: Iterable[int],
    superseded: Callable[[], bool],
) -> None:
    """Connect ``group`` (of ``generation``) with ``peers`` beyond its ring neighbours, before
    a transfer between them (each of ``peers`` connects with this rank at the same time)."""
    connect(group, _arrivals(store, generation, superseded), peers)


def _arrivals(store: dist.Store, generation: int, superseded: Callable[[], bool]) -> Rendezvous:
    prefixed = dist.PrefixStore(f"gen/{generation}/", store)
    return Rendezvous(prefixed, superseded, f"generation {generation}")


def drop(group: Group) -> None:
    """Close the group's connections (the caller must drop its last reference too)."""
    with contextlib.suppress(RuntimeError):  # a broken group may refuse a clean shutdown
        group.shutdown()
