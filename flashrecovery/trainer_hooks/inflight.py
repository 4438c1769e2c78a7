"""Waiting for a collective that a newer generation may leave behind.

A survivor can be blocked in a collective of its generation by a peer that is alive but stuck
in its own code (a stall): no connection closes, so gloo waits out the collective timeout, and
neither ``abort()`` nor ``shutdown()`` of a gloo group ends an operation in flight. Its
heartbeats still name the old generation, so once a newer generation is planned the engine
would find it silent too and fail a healthy rank with the stuck one. Here such a wait gives up
as soon as a newer generation is planned, and the group is kept with its work until the work
ends (the stuck peer is SIGKILLed, its connections close): dropping a gloo group with work in
flight waits for that work, which would hold the training thread in the old generation again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch.distributed as dist

from flashrecovery.errors import Superseded

POLL_S = 0.1  # how soon a newer generation's plan ends the wait

_left_behind: list[tuple[object, dist.Work]] = []  # (group, its work still in flight)
_lock = threading.Lock()


def wait(work: dist.Work, group: object, superseded: Callable[[], bool]) -> None:
    """Wait for ``work`` (a collective of ``group``) and raise its error; raise ``Superseded``
    once ``superseded()`` holds, leaving the work behind with its group."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    while not done.wait(POLL_S):
        if superseded():
            with _lock:
                _left_behind.append((group, work))
            raise Superseded("a newer generation was planned while a collective waited")
    work.wait()


def release_finished() -> None:
    """Let go of the groups left behind whose work has ended (dropping them is cheap now)."""
    with _lock:
        _left_behind[:] = [(g, w) for g, w in _left_behind if not w.is_completed()]
