"""Seeing a rank's process die as the kernel starts tearing it down, not once it is gone.

A SIGKILLed process is reaped (its pidfd readable, its sockets closed) only after the kernel
has unmapped its memory: 40-50 ms for a process that imported torch here (half a gigabyte of
mapped libraries), more with a larger heap. A process's death is known earlier than that:
the kernel releases the robust mutexes a dying thread holds before it touches its memory.
So each process the agent starts locks a robust, process-shared pthread mutex in a small
file the agent made (``hold()``, on its main thread, first thing), and a thread of the agent
waits to lock it too (``Watch.wait``): the lock is granted with EOWNERDEAD the moment the
holder's main thread dies, and the process's wait status is then already in
/proc/<pid>/stat (the kernel sets it before the release). Its exit is reported from there,
the reap after it only confirming it.

Only where the futex system call's number is known (x86-64, aarch64); elsewhere, and for a
process that never holds its mutex (it failed before), the reap reports the exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

ENV = "FLASHRECOVERY_DEATH_WATCH"  # the file of the mutex a started process holds
_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
SUPPORTED = _FUTEX_SYSCALL is not None
_MUTEX_BYTES = 64  # a pthread_mutex_t (40 bytes on x86-64, 48 on aarch64), then the flag
_FLAG = _MUTEX_BYTES  # a 32-bit word: 1 once the holder holds the mutex (a futex)
_FILE_BYTES = 128
_PROCESS_SHARED, _ROBUST = 1, 1  # PTHREAD_PROCESS_SHARED, PTHREAD_MUTEX_ROBUST
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: not the _PRIVATE variants
HELD_WAIT_S = 0.1  # how often a watch that waits for its holder looks whether it has ended

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex(address: int, op: int, value: int, timeout_s: float | None = None) -> None:
    timeout = None
    if timeout_s is not None:
        seconds = int(timeout_s)
        timeout = ctypes.byref(_Timespec(seconds, int((timeout_s - seconds) * 1e9)))
    _libc.syscall(_FUTEX_SYSCALL, ctypes.c_void_p(address), op, value, timeout, None, 0)


class Watch:
    """The agent's side for one process: the mutex's file (its path goes into the process's
    environment as ``ENV``), and the wait for the process's death."""

    def __init__(self, directory: Path) -> None:
        fd, name = tempfile.mkstemp(prefix="watch-", dir=directory)
        self.path = Path(name)
        try:
            os.ftruncate(fd, _FILE_BYTES)
            self._mapped = mmap.mmap(fd, _FILE_BYTES)
        finally:
            os.close(fd)
        self._mutex_view = ctypes.c_char.from_buffer(self._mapped)
        self._held = ctypes.c_int.from_buffer(self._mapped, _FLAG)
        self._mutex = ctypes.addressof(self._mutex_view)
        attributes = ctypes.create_string_buffer(64)  # a pthread_mutexattr_t (4 bytes)
        for call in (
            lambda: _libc.pthread_mutexattr_init(attributes),
            lambda: _libc.pthread_mutexattr_setpshared(attributes, _PROCESS_SHARED),
            lambda: _libc.pthread_mutexattr_setrobust(attributes, _ROBUST),
            lambda: _libc.pthread_mutex_init(ctypes.c_void_p(self._mutex), attributes),
        ):
            failed = call()
            if failed:
                self.close()
                raise OSError(failed, f"a robust mutex for the death watch: {os.strerror(failed)}")
        _libc.pthread_mutexattr_destroy(attributes)

    def wait(self, ended: Callable[[], bool]) -> bool:
        """Block until the holder dies (True) or lets go of the mutex, or ``ended()`` holds
        before it ever held it (False). On a thread of its own: the lock blocks in C."""
        while not self._held.value:
            if ended():
                return False
            _futex(ctypes.addressof(self._held), _FUTEX_WAIT, 0, HELD_WAIT_S)
        self._unlink()  # the holder has opened it: nothing else will
        return bool(_libc.pthread_mutex_lock(ctypes.c_void_p(self._mutex)) == errno.EOWNERDEAD)

    def close(self) -> None:
        """Let go of the mutex's memory (a waiting ``wait`` must have returned)."""
        self._unlink()
        del self._mutex_view, self._held  # the mapping closes only once no view is left
        self._mapped.close()

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def exit_status(pid: int) -> int | None:
    """A dying process's exit code as ``Popen.returncode`` gives it (negative: the signal),
    read from /proc/<pid>/stat (its last field, the wait status); None if it cannot be read
    (the process is already gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return os.waitstatus_to_exitcode(int(fields[-1]))


def hold() -> None:
    """In a process the agent started (first thing, on its main thread): lock the mutex of
    ``ENV`` for the process's whole life. Nothing if the agent made none. Mapped through libc,
    never unmapped: a mapping the interpreter let go of at its exit (a Python ``mmap``'s) is
    gone when the kernel looks for the mutex, and an exit of the process's own is then never
    seen."""
    path = os.environ.pop(ENV, None)  # not inherited by the script's own children
    if path is None or not SUPPORTED:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        base = _libc.mmap(
            None, _FILE_BYTES, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0
        )
    finally:
        os.close(fd)
    if base in (None, _MAP_FAILED):
        return
    if _libc.pthread_mutex_lock(ctypes.c_void_p(base)):
        return
    ctypes.c_int.from_address(base + _FLAG).value = 1
    _futex(base + _FLAG, _FUTEX_WAKE, 1)
