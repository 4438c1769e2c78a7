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

A member whose step is not finite (trainer_hooks/nonfinite.py) adds ``NONFINITE`` with its
vote, having first written what it found under the vote's key: a full vote with any such
addition says "non-finite" instead of "committed", and no member steps. A member that saw the
same step's earlier attempt end so says it before it votes (``/again``), so every member learns
together whether this is the step's first non-finite attempt or its recompute, even a
replacement that never saw the first. On a step the replicas compare their states (``--verify-
every``), each member appends its shard's digest under the vote's key before it votes: a full
vote whose digests differ within a shard says "diverged", and nobody steps (digest.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch.distributed as dist

from flashrecovery.trainer_hooks.groups import COLLECTIVE_TIMEOUT, WAIT_SLICE

# A count is closes x CLOSED + non-finite votes x NONFINITE + votes (an int64 in the store):
# worlds below 2**20 ranks (a million); with each member closing it twice at most (its own
# thread and its releaser) the count stays far below 2**63.
NONFINITE = 1 << 20
CLOSED = 1 << 40


class Verdict(StrEnum):
    COMMITTED = "committed"
    ABORTED = "aborted"
    NONFINITE = "nonfinite"  # every member voted, some step was not finite: nobody steps
    NONFINITE_AGAIN = "nonfinite-again"  # and so was the step's attempt before
    DIVERGED = "diverged"  # every member voted, two replicas of a shard hold different states


@dataclass(frozen=True)
class Ballot:
    """What a member says of its step along with its vote."""

    nonfinite: str | None = None  # what of it was NaN or infinite, in a few words
    again: bool = False  # this member saw the step's last attempt end non-finite
    digest: str | None = None  # "shard:digest" of its state, on a step the replicas compare


FINITE = Ballot()


def vote_key(generation: int, step: int, attempt: int = 0) -> str:
    """The vote on ``step``'s ``attempt`` in ``generation``: a step is voted on again by the
    same members after it was found non-finite (and computed again), or after its vote closed
    with no failure behind it (``StepRetried``); a recovery makes a new generation instead."""
    return f"gen/{generation}/vote/{step}" + (f"/{attempt}" if attempt else "")


def _finish(store: dist.Store, key: str, verdict: Verdict) -> Verdict:
    store.set(f"{key}/verdict", verdict.value)
    return verdict


def _append(store: dist.Store, key: str, value: str) -> None:
    store.append(key, value)  # type: ignore[attr-defined]  # torch's (2.3 on), not in its stubs


def _tally(count: int) -> tuple[int, int, int]:
    """(closes, non-finite votes, votes) of a vote's count."""
    closes, rest = divmod(count, CLOSED)
    nonfinite, votes = divmod(rest, NONFINITE)
    return closes, nonfinite, votes


def diverged(digests: str) -> bool:
    """Whether two of the ``shard:digest;`` entries name one shard with different digests."""
    seen: dict[str, str] = {}
    for entry in filter(None, digests.split(";")):
        shard, _, digest = entry.strip().partition(":")
        if seen.setdefault(shard, digest) != digest:
            return True
    return False


def _full(store: dist.Store, key: str, nonfinite: int, verify: bool | None) -> Verdict:
    """The verdict of a vote every member cast (``verify``: whether its members compared
    their states; None: not known here, look)."""
    if verify is None:
        verify = store.check([f"{key}/digests"])
    if verify and diverged(store.get(f"{key}/digests").decode()):
        return Verdict.DIVERGED  # first: a corrupted state may well compute a NaN
    if not nonfinite:
        return Verdict.COMMITTED
    return Verdict.NONFINITE_AGAIN if store.check([f"{key}/again"]) else Verdict.NONFINITE


def cast(store: dist.Store, key: str, world_size: int, ballot: Ballot = FINITE) -> Verdict | None:
    """Add this member's vote; the verdict if the vote is now final, else None (wait for it)."""
    if ballot.again:
        store.set(f"{key}/again", "1")
    if ballot.digest is not None:
        _append(store, f"{key}/digests", f"{ballot.digest};")
    if ballot.nonfinite is not None:
        _append(store, f"{key}/nonfinite", f"{ballot.nonfinite}; ")
    count = store.add(key, 1 + (NONFINITE if ballot.nonfinite is not None else 0))
    closes, nonfinite, votes = _tally(count)
    if closes:  # closed before this vote came: it was not full then
        return _finish(store, key, Verdict.ABORTED)
    if votes == world_size:
        return _finish(store, key, _full(store, key, nonfinite, ballot.digest is not None))
    return None


def nonfinite_found(store: dist.Store, key: str) -> str:
    """What the members that voted non-finite found (read once the verdict says so)."""
    return store.get(f"{key}/nonfinite").decode().rstrip("; ")


def close(store: dist.Store, key: str, world_size: int) -> Verdict:
    """Close the vote unless it is already full; return (and publish) its final verdict. The
    first closer settles it; a later one knows it too unless every member had voted by then (a
    vote full before the first close keeps its votes' verdict, one filled after it aborts):
    then it waits for the verdict like a voter."""
    closes, nonfinite, votes = _tally(store.add(key, CLOSED))
    if closes == 1:
        full = votes == world_size
        verdict = _full(store, key, nonfinite, None) if full else Verdict.ABORTED
        return _finish(store, key, verdict)
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
