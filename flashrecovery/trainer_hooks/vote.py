"""The step vote on the store (docs/protocol.md, "A step"): a step commits for every member of
a generation or for none.

The vote key counts: each member adds 1 as its vote, and a member that closes the vote because
the job moved to a newer generation adds ``CLOSED``. ``Store.add`` answers with the count right
after its own addition, atomically, so one round trip tells a voter whether it was the last
(the count is the world size: committed), one too late (the count is at or above ``CLOSED``: the
vote was closed first, aborted), or neither (it waits for the verdict). A step's critical path
is the last voter's: one round trip and the verdict's publication, however many members vote at
once. Whoever makes the vote final (the last voter, or the first closer) writes the verdict key
that the other members wait on; a late voter and a later closer that know the verdict write it
too (the same value), so it is published unless every one of them dies at that moment.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum

import torch.distributed as dist

from flashrecovery.trainer_hooks.groups import COLLECTIVE_TIMEOUT, WAIT_SLICE

CLOSED = 1 << 32  # what a closer adds: far above any world size


class Verdict(StrEnum):
    COMMITTED = "committed"
    ABORTED = "aborted"


def vote_key(generation: int, step: int) -> str:
    return f"gen/{generation}/vote/{step}"


def _finish(store: dist.Store, key: str, verdict: Verdict) -> Verdict:
    store.set(f"{key}/verdict", verdict.value)
    return verdict


def cast(store: dist.Store, key: str, world_size: int) -> Verdict | None:
    """Add this member's vote; the verdict if the vote is now final, else None (wait for it)."""
    count = store.add(key, 1)
    if count >= CLOSED:  # closed before this vote came: it was not full then
        return _finish(store, key, Verdict.ABORTED)
    if count == world_size:
        return _finish(store, key, Verdict.COMMITTED)
    return None


def close(store: dist.Store, key: str, world_size: int) -> Verdict:
    """Close the vote unless it is already full; return (and publish) its final verdict. The
    first closer settles it; a later one knows it too unless every member had voted by then (a
    vote full before the first close commits, one filled after it aborts): then it waits for
    the verdict like a voter."""
    count = store.add(key, CLOSED)
    votes, closes = count % CLOSED, count // CLOSED
    if closes == 1:
        return _finish(store, key, Verdict.COMMITTED if votes == world_size else Verdict.ABORTED)
    if votes < world_size:
        return _finish(store, key, Verdict.ABORTED)
    return Verdict(store.get(f"{key}/verdict").decode())  # the first closer publishes it


def wait(store: dist.Store, key: str, world_size: int, superseded: Callable[[], bool]) -> Verdict:
    """Block until the vote is final: in slices, so a newer generation planned meanwhile ends
    the wait (closing the vote) even when no release can reach the store (its host cut off);
    bounded by COLLECTIVE_TIMEOUT, after which it is settled here by closing it."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    verdict = f"{key}/verdict"
    while True:
        try:
            store.wait([verdict], WAIT_SLICE)
            return Verdict(store.get(verdict).decode())
        except dist.DistStoreError:
            if superseded() or time.monotonic() > deadline:
                return close(store, key, world_size)
