"""Letting go of a lazily connecting gloo device without hanging on its event loop.

A gloo tcp device runs one event loop thread over an epoll descriptor. A lazily connecting
context shuts that loop down *before* it closes its pairs, and the loop only ends on a tick
with no event. A pair can stay ready for ever: when a collective ends with an error (a peer
lost) while another pair of it was receiving from a live peer, that pair's receive buffer is
gone, and gloo leaves the rest of the message unread (``Pair::prepareRead`` returns at once for
a vanished buffer). The descriptor stays readable, the loop spins on it, and the destructor
joins the loop for ever, holding the dropping thread (an eagerly connected context closes its
pairs first, so it never meets this).

So before such a device is let go of, every socket its loop watches is made silent: its entry
in the loop's epoll set is changed to ask for no event, edge-triggered (so a hang-up or an error,
which epoll always reports, is reported once, not on every tick). The loop then ticks empty and
ends, and the pairs close their sockets as they are destroyed. The entries stay in the set:
gloo's loop thread may be closing a pair at that very moment, and it treats a missing entry as
fatal (``epoll_ctl`` failing ends the process). The loop's descriptor is found when the device
is created (the one epoll descriptor it opens), the sockets from the kernel's list of what that
descriptor watches (``/proc/self/fdinfo``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import select
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

_EVENT_POLL = "anon_inode:[eventpoll]"
_WATCHED = re.compile(r"^tfd:\s*(\d+)\s+events:\s*[0-9a-f]+\s+data:\s*([0-9a-f]+)", re.MULTILINE)
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


def _watched(poll: int) -> Iterator[tuple[int, int]]:
    """(descriptor, gloo's handler pointer) of every entry of the epoll set ``poll``."""
    try:
        listing = Path(f"/proc/self/fdinfo/{poll}").read_text()
    except OSError:
        return
    for match in _WATCHED.finditer(listing):
        yield int(match.group(1)), int(match.group(2), 16)


def _is_socket(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False


class _EpollEvent(ctypes.Structure):
    """The kernel's ``struct epoll_event`` (packed on x86-64)."""

    _pack_ = 1 if platform.machine() == "x86_64" else 0
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_EPOLL_CTL_MOD = 3


def quiesce(polls: list[int]) -> None:
    """Silence every socket of the epoll sets ``polls`` (a device's loops, still open: the
    caller holds the device). Nothing may be in flight on the device: its operations would
    never hear from their sockets again. Each entry keeps gloo's handler pointer (Python's own
    ``epoll.modify`` would put the descriptor there, which gloo would call as a handler)."""
    for poll in polls:
        for fd, handler in _watched(poll):
            if _is_socket(fd):
                # A descriptor closed meanwhile, or reused for a socket this set does not
                # watch, is refused by the kernel: nothing else is touched.
                event = _EpollEvent(select.EPOLLET, handler)
                _libc.epoll_ctl(poll, _EPOLL_CTL_MOD, fd, ctypes.byref(event))
