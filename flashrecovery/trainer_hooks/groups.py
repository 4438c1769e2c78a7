"""Process groups per generation: generation g's gloo group lives under ``gen/{g}/`` of the
agent's store, so a new generation never meets the keys of an old one. Every key of the job
lives under its secret prefix (agent/store.py).

Dropping a group must close its connections at once: a peer still blocked in a collective of
the old generation then fails in milliseconds instead of waiting for the collective timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist

# Bounds every collective and the rendezvous of a new group; a hung peer is found earlier by
# the heartbeat detector and SIGKILLed, which breaks its peers' collectives at once.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
RENDEZVOUS_SLICE = datetime.timedelta(seconds=0.1)  # how soon a lost peer's supersession shows


class Group(Protocol):
    """What the hook uses of a gloo group (torch's stubs omit these methods on backends)."""

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> dist.Work: ...

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int) -> dist.Work: ...

    def shutdown(self) -> None: ...


def job_keys(prefix: str, store: dist.Store) -> dist.Store:
    """The job's view of the store: every key under its secret prefix."""
    return dist.PrefixStore(f"{prefix}/", store)


def connect_store(host: str, port: int, prefix: str) -> dist.Store:
    """A client of the agent's store, seeing the job's keys; each thread that blocks on the
    store gets its own."""
    client = dist.TCPStore(
        host, port, is_master=False, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
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
        while True:
            if self._superseded():
                raise dist.DistStoreError(f"{self._what} was superseded while its group formed")
            try:
                self._inner.wait(keys, RENDEZVOUS_SLICE)
                return
            except dist.DistStoreError:
                if time.monotonic() > deadline:
                    raise


def build(
    store: dist.Store,
    generation: int,
    rank: int,
    world_size: int,
    superseded: Callable[[], bool],
) -> Group:
    """Rendezvous with every member of ``generation`` and return its gloo group. Call it once
    the generation's member barrier has passed (barrier.py), so every peer is there; a peer
    lost after that is given up on once ``superseded()`` says a newer generation is planned.
    Gloo listens on the interface GLOO_SOCKET_IFNAME names (loopback: agent/store.py)."""
    prefixed = dist.PrefixStore(f"gen/{generation}/", store)
    rendezvous = Rendezvous(prefixed, superseded, f"generation {generation}")
    return cast(Group, dist.ProcessGroupGloo(rendezvous, rank, world_size, COLLECTIVE_TIMEOUT))


def drop(group: Group) -> None:
    """Close the group's connections (the caller must drop its last reference too)."""
    with contextlib.suppress(RuntimeError):  # a broken group may refuse a clean shutdown
        group.shutdown()
