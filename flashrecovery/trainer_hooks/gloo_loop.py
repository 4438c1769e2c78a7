"""Letting go of a lazily connecting gloo device without hanging on its event loop.

A gloo tcp device runs one event loop thread over an epoll descriptor. A lazily connecting
context shuts that loop down *before* it closes its pairs, and the loop only ends on a tick
with no event. A pair can stay ready for ever: when a collective ends with an error (a peer
lost) while another pair of it was receiving from a live peer, that pair's receive buffer is
gone, and gloo leaves the rest of the message unread (``Pair::prepareRead`` returns at once for
a vanished buffer). The descriptor stays readable, the loop spins on it, and the destructor
joins the loop for ever, holding the dropping thread (an eagerly connected context closes its
pairs first, so it never meets this).

So before such a device is let go of, every socket is taken out of its loop's epoll set: the
loop then ticks empty and ends, and the pairs close their sockets as they are destroyed. The
loop's descriptor is found when the device is created (the one epoll descriptor it opens), the
sockets from the kernel's list of what that descriptor watches (``/proc/self/fdinfo``).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

_EVENT_POLL = "anon_inode:[eventpoll]"
_WATCHED = re.compile(r"^tfd:\s*(\d+)", re.MULTILINE)
_creating = threading.Lock()  # so a device's new epoll descriptor is its own, not a neighbour's

T = TypeVar("T")


def _event_polls() -> set[int]:
    polls = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            if os.readlink(f"/proc/self/fd/{name}") == _EVENT_POLL:
                polls.add(int(name))
    return polls


def created_with_polls(create: Callable[[], T]) -> tuple[T, list[int]]:
    """``create()`` (gloo devices) and the epoll descriptors it opened: its loops'."""
    with _creating:
        before = _event_polls()
        made = create()
        return made, sorted(_event_polls() - before)


def _watched(poll: int) -> Iterator[int]:
    try:
        listing = Path(f"/proc/self/fdinfo/{poll}").read_text()
    except OSError:
        return
    for match in _WATCHED.finditer(listing):
        yield int(match.group(1))


def _is_socket(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False


def quiesce(polls: list[int]) -> int:
    """Take every socket out of the epoll sets ``polls`` (a device's loops, still open: the
    caller holds the device). Nothing may be in flight on the device: its operations would
    never hear from their sockets again. Returns how many sockets were taken out."""
    taken = 0
    for poll in polls:
        loop = select.epoll.fromfd(os.dup(poll))  # the same epoll set, closed on its own
        try:
            for fd in _watched(poll):
                if _is_socket(fd):
                    # A descriptor closed meanwhile, or reused for a socket this set does not
                    # watch, is refused by the kernel: nothing else is touched.
                    with contextlib.suppress(OSError):
                        loop.unregister(fd)
                        taken += 1
        finally:
            loop.close()
    return taken
