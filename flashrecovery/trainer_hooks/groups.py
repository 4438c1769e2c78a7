"""Process groups per generation: generation g's gloo group lives under ``gen/{g}/`` of the
agent's store, so a new generation never meets the keys of an old one. Every key of the job
lives under its secret prefix (agent/store.py).

Dropping a group must close its connections at once: a peer still blocked in a collective of
the old generation then fails in milliseconds instead of waiting for the collective timeout.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist

# Bounds every collective and the rendezvous of a new group; a hung peer is found earlier by
# the heartbeat detector and SIGKILLed, which breaks its peers' collectives at once.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


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


def build(store: dist.Store, generation: int, rank: int, world_size: int) -> Group:
    """Rendezvous with every member of ``generation`` and return its gloo group. Call it once
    the generation's member barrier has passed (barrier.py), so every peer is there. Gloo
    listens on the interface GLOO_SOCKET_IFNAME names (loopback: agent/store.py)."""
    prefixed = dist.PrefixStore(f"gen/{generation}/", store)
    return cast(Group, dist.ProcessGroupGloo(prefixed, rank, world_size, COLLECTIVE_TIMEOUT))


def drop(group: Group) -> None:
    """Close the group's connections (the caller must drop its last reference too)."""
    with contextlib.suppress(RuntimeError):  # a broken group may refuse a clean shutdown
        group.shutdown()
