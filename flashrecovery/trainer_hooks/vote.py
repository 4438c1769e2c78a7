"""The step vote on the store (docs/protocol.md, "A step"): a step commits for every member of
a generation or for none.

The vote key holds the sorted ranks that voted (``"0,2"``), or ``"closed:0,2"`` once a member
closed it because the job moved to a newer generation. Voter sets rather than counts, because
``Store.compare_set`` answers with the current value both when it swaps and when it doesn't: a
value that names this rank can only have been written by this rank, so the answer is never
ambiguous. Whoever makes the vote final (the last voter, or a closer) writes the verdict key that
the other members wait on.
"""

from __future__ import annotations

from enum import StrEnum

import torch.distributed as dist

CLOSED = "closed:"


class Verdict(StrEnum):
    COMMITTED = "committed"
    ABORTED = "aborted"


def vote_key(generation: int, step: int) -> str:
    return f"gen/{generation}/vote/{step}"


def _voters(value: str) -> set[int]:
    body = value.removeprefix(CLOSED)
    return {int(r) for r in body.split(",")} if body else set()


def _value(voters: set[int]) -> str:
    return ",".join(str(r) for r in sorted(voters))


def _finish(store: dist.Store, key: str, verdict: Verdict) -> Verdict:
    store.set(f"{key}/verdict", verdict.value)
    return verdict


def cast(store: dist.Store, key: str, rank: int, world_size: int) -> Verdict | None:
    """Add this rank's vote; the verdict if the vote is now final, else None (wait for it)."""
    current = ""
    while True:
        if current.startswith(CLOSED):
            return Verdict.ABORTED
        voters = _voters(current) | {rank}
        desired = _value(voters)
        current = store.compare_set(key, current, desired).decode()
        if current == desired:
            break
    if len(voters) == world_size:
        return _finish(store, key, Verdict.COMMITTED)
    return None


def close(store: dist.Store, key: str, world_size: int) -> Verdict:
    """Close the vote unless it is already full; return (and publish) its final verdict."""
    current = ""
    while True:
        if current.startswith(CLOSED):
            return _finish(store, key, Verdict.ABORTED)
        if len(_voters(current)) == world_size:
            return _finish(store, key, Verdict.COMMITTED)
        desired = CLOSED + current
        current = store.compare_set(key, current, desired).decode()
        if current == desired:
            return _finish(store, key, Verdict.ABORTED)


def wait(store: dist.Store, key: str) -> Verdict:
    """Block until the vote is final, bounded by the store client's timeout (raises then like
    any store wait). One ``get``: it waits for the key itself, so a separate ``wait`` first
    would only add a round trip to the store on every step (bench/overhead.py)."""
    return Verdict(store.get(f"{key}/verdict").decode())
