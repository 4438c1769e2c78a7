"""Store barriers of a generation that a newer generation can release.

Members wait at a barrier until all of them arrived (it *passes*) or until a member that saw a
newer plan *supersedes* it: a peer that died will never arrive, and nobody should wait for it
until a timeout. Two per generation: ``members`` before the group is built (so nobody sits in
gloo's own rendezvous for a peer that will never come) and ``done`` before a rank reports
itself finished (so a rank lost after the last commit is still replaced from a live replica).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from flashrecovery.trainer_hooks.groups import WAIT_SLICE

PASSED, SUPERSEDED = "passed", "superseded"


def name(generation: int, barrier: str) -> str:
    return f"gen/{generation}/{barrier}"


def wait(
    store: dist.Store,
    key: str,
    world_size: int,
    timeout: datetime.timedelta,
    superseded: Callable[[], bool] = lambda: False,
) -> bool:
    """Arrive and wait: True when every member arrived, False when superseded. The outcome is
    set once (compare-and-set from empty), so all members see the same one. The wait looks for
    a newer generation every slice, so it ends even when no release can reach the store; past
    ``timeout`` it raises DistStoreError like any store wait."""
    if store.add(f"{key}/arrived", 1) == world_size:
        store.compare_set(f"{key}/result", "", PASSED)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            store.wait([f"{key}/result"], WAIT_SLICE)
            return store.get(f"{key}/result").decode() == PASSED
        except dist.DistStoreError:
            if superseded():
                supersede(store, key)
            elif time.monotonic() > deadline:
                raise


def passed(store: dist.Store, key: str) -> bool:
    """Whether the barrier has passed (without waiting: for onlookers such as the agents)."""
    result = f"{key}/result"
    return store.check([result]) and store.get(result).decode() == PASSED


def supersede(store: dist.Store, key: str) -> None:
    """Release the members waiting at a barrier that can't pass any more (unless it passed)."""
    store.compare_set(f"{key}/result", "", SUPERSEDED)
