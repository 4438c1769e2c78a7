"""Wake-ups for followers of the embedded log, across processes, without polling SQLite.

After each commit a writer rewrites one byte of a small file per stream it wrote
(``<db>-events.signal``, ``<db>-decisions.signal``), and a follower blocks on Linux's inotify
until its stream's file changes. So a follower wakes once per commit to its own stream, at
once, and not at all while nothing is written: the agent's engine used to poll the file
every 5-20 ms between a step's records and the next step's, and its decisions follower every
20 ms through the whole job, on the cores the ranks train on (docs/benchmarks.md, "Where the time
goes"). Where inotify is missing (not Linux), ``Waiter.open`` gives None and followers poll.

A commit that is not *routine* also rings a second file (``<db>-events.urgent.signal``): a
follower that acts on nothing routine at once (the engine, on a step's records) waits on that
one and finds the routine records when it looks on its own, instead of waking for every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import sys
import threading
from pathlib import Path

from flashrecovery.records import Stream

_IN_MODIFY = 0x00000002
_IN_IGNORED = 0x00008000  # the watch is gone: the file was deleted (or its file system unmounted)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


def _inotify() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _inotify()


def signal_path(db: Path, stream: Stream, urgent: bool = False) -> Path:
    """The file rung by every commit to ``stream``, or (``urgent``) by those not routine."""
    return db.with_name(f"{db.name}-{stream.value}{'.urgent' if urgent else ''}.signal")


class Signaller:
    """A writer's side: ``ring(stream, routine)`` after a commit to ``stream``."""

    def __init__(self, db: Path) -> None:
        self._db = db
        self._fds: dict[tuple[Stream, bool], int] = {}
        self._lock = threading.Lock()

    def ring(self, stream: Stream, routine: bool = False) -> None:
        """Best effort: a follower that misses a ring still looks on its own now and then."""
        with self._lock:
            for urgent in (False,) if routine else (False, True):
                try:
                    fd = self._fds.get((stream, urgent))
                    if fd is None:
                        fd = _create(signal_path(self._db, stream, urgent))
                        self._fds[(stream, urgent)] = fd
                    os.pwrite(fd, b"\0", 0)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def _create(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)


class Waiter:
    """A follower's side, for one stream, used by one thread of one process; ``close`` may
    come from another thread while it waits (the log closing): it cancels the wait first, so
    no descriptor is closed under a wait (a number reused meanwhile would be read)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._cancel = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()  # held by a wait, and by close while it closes
        self._closing_lock = threading.Lock()
        self._closing = False
        self.lost = False  # the watched file went away (or closed): follow polls instead

    @classmethod
    def open(cls, db: Path, stream: Stream, urgent: bool = False) -> Waiter | None:
        """A waiter for every commit to ``stream``, or (``urgent``) for those not routine;
        None without inotify, or when the signal file cannot be watched."""
        if _LIBC is None:
            return None
        path = signal_path(db, stream, urgent)
        try:
            os.close(_create(path))
        except OSError:
            return None  # a read-only place: no writer rings here either
        fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        if _LIBC.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
            os.close(fd)
            return None
        return cls(fd)

    def clear(self) -> None:
        """Forget the rings so far (before a look at the log: a later one means news)."""
        with self._lock:
            self._drain()

    def wait(self, timeout: float) -> None:
        """Until the stream's file is rung (or was already, since ``clear``) or ``timeout``."""
        with self._lock:
            if not self._closing:  # poll, not select: a process may hold fds past 1024
                poller = select.poll()
                for fd in (self._fd, self._cancel):
                    poller.register(fd, select.POLLIN)
                poller.poll(max(timeout, 0.0) * 1000)
            self._drain()

    def _drain(self) -> None:
        while not self._closing:
            try:
                data = os.read(self._fd, 4096)
            except BlockingIOError:
                return
            while data:
                _, mask, _, length = _EVENT.unpack_from(data)
                self.lost |= bool(mask & _IN_IGNORED)
                data = data[_EVENT.size + length :]

    def close(self) -> None:
        """Cancel a wait in another thread, then close once it has ended."""
        with self._closing_lock:
            if self._closing:
                return
            self._closing = True
            os.eventfd_write(self._cancel, 1)
        with self._lock:
            self.lost = True
            os.close(self._fd)
            os.close(self._cancel)

    def forget(self) -> None:
        """In a forked child: close this process's copies without waking the parent's wait
        (the cancel would be the parent's too)."""
        self._closing = self.lost = True
        os.close(self._fd)
        os.close(self._cancel)
