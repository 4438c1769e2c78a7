"""Waiting for a collective that a newer generation may leave behind.

A survivor can be blocked in a collective of its generation by a peer that is alive but stuck
in its own code (a stall): no connection closes, so gloo waits out the collective timeout, and
neither ``abort()`` nor ``shutdown()`` of a gloo group ends an operation in flight. Its
heartbeats still name the old generation, so once a newer generation is planned the engine
would find it silent too and fail a healthy rank with the stuck one. Here such a wait gives up
as soon as a newer generation is planned, and the group is kept with its work until the work
ends (the stuck peer is SIGKILLed, its connections close): dropping a gloo group with work in
flight waits for that work, which would hold the training thread in the old generation again.

A wait in Python (the hook's all-reduce, FSDP2's ``work.wait()``) polls for the plan itself
(``wait``); DDP's reducer waits on a collective's future inside torch, so ``future`` hands out
one that a watcher thread fails with ``Superseded`` once told that a newer generation is
planned (``poke``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from flashrecovery.errors import Superseded
from flashrecovery.trainer_hooks.groups import COLLECTIVE_TIMEOUT

POLL_S = 0.1  # how soon a newer generation's plan ends a wait in Python
POLL = datetime.timedelta(seconds=POLL_S)
IDLE_LOOK_S = 1.0  # the watcher's own look, should a plan come without a poke

# (group, set once its work still in flight ends): gloo leaves some works incomplete for
# ``is_completed()`` even after they ended (a reduce-scatter's)
_left_behind: list[tuple[object, threading.Event]] = []
# The groups of settled collectives, kept until a thread of the process's own lets go of them:
# ``settle`` runs on a gloo worker thread, and were the last reference to a group dropped there,
# the group's destructor would join that very thread (std::system_error: the process aborts).
_settled: list[object] = []
_lock = threading.Lock()


class _Pending:
    """A collective in flight and the future handed out for it, settled once: by the work, or
    by a newer generation's plan (then the work is left behind)."""

    def __init__(self, group: object, superseded: Callable[[], bool]) -> None:
        self.group: object | None = group
        self.superseded = superseded
        self.ended = threading.Event()
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self._settled = threading.Lock()
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def _claim(self) -> bool:
        with self._settled:
            first, self._done = not self._done, True
            return first

    def settle(self, source: torch.futures.Future[Any]) -> None:
        """The work ended: pass on its value or its error. On a gloo thread, so the group
        goes to ``_settled`` without a reference left here (the next ``future()`` or
        ``release_finished()`` lets go of it)."""
        self.ended.set()
        _watcher.forget(self)  # its group is not held on to past its work
        with _lock:
            _settled.append(self.group)
            self.group = None
        if not self._claim():
            return
        try:
            value = source.value()
        except Exception as exc:  # gloo's error, passed on as it is
            self.future.set_exception(exc)
        else:
            self.future.set_result(value)

    def give_up(self) -> None:
        if self._claim():
            self.future.set_exception(_leave_behind(self.group, self.ended))


class _Watcher:
    """One thread per process that gives up on the pending collectives of a superseded
    generation. It sleeps until ``poke()`` says a newer generation is planned (a wake-up per
    collective, DDP's buckets included, cost the training thread a context switch and the GIL
    on every bucket; python -m bench.overhead), and looks on its own only every ``IDLE_LOOK_S``."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._changed = threading.Condition()
        self._poked = False
        self._thread: threading.Thread | None = None

    def watch(self, pending: _Pending) -> None:
        with self._changed:
            self._pending.append(pending)
            if pending.ended.is_set():  # it ended meanwhile, and settle() found nothing to forget
                self._pending.remove(pending)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="flashrecovery-inflight", daemon=True
                )
                self._thread.start()
        # After the append: a plan that came before it is seen here, one after it by the watcher.
        if pending.superseded():
            pending.give_up()

    def forget(self, pending: _Pending) -> None:
        with self._changed, contextlib.suppress(ValueError):  # not watched: it ended at once
            self._pending.remove(pending)

    def poke(self) -> None:
        with self._changed:
            self._poked = True
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._poked, IDLE_LOOK_S)
                self._poked = False
                pending = list(self._pending)
            for entry in pending:
                if not entry.done and entry.superseded():
                    entry.give_up()


_watcher = _Watcher()


def future(
    work: dist.Work, group: object, superseded: Callable[[], bool]
) -> torch.futures.Future[Any]:
    """``work``'s future (``work`` a collective of ``group``), failed with ``Superseded`` once
    ``superseded()`` holds while the work is in flight; the work is then left behind with its
    group."""
    _let_go_of_settled()
    pending = _Pending(group, superseded)
    work.get_future().add_done_callback(pending.settle)
    if not pending.done:
        _watcher.watch(pending)
    return pending.future


def poke() -> None:
    """A newer generation was planned: the collectives it leaves behind give up now."""
    _watcher.poke()


def wait(work: dist.Work, group: object, superseded: Callable[[], bool]) -> None:
    """Wait for ``work`` (a collective of ``group``) and raise its error; raise ``Superseded``
    once ``superseded()`` holds, leaving the work behind with its group. A work already
    complete is waited for at once, one in flight in torch's own wait with a timeout (a
    timeout raises, the work goes on): a watch (a callback that takes the GIL on gloo's
    thread, an event) is a hand-off between two threads per collective on cores the ranks
    fill, and FSDP2 waits for a dozen collectives a step."""
    if work.is_completed():
        work.wait()
        return
    future = _future_of(work)
    if future is None or not _on_cpu(work):
        ending = _Ending(work, future)
        while not ending.ended.wait(POLL_S):
            if superseded():
                raise _leave_behind(group, ending.ended)
        ending.outcome()
        return
    # Waited for in torch, in slices: no hand-off to a Python callback on gloo's thread.
    while True:
        try:
            work.wait(POLL)
            return
        except RuntimeError:
            if work.is_completed():  # its own error (or it ended as the slice did): as it is
                work.wait()
                return
            if superseded():
                raise _leave_behind(group, _Ending(work, future).ended) from None


def _future_of(work: dist.Work) -> torch.futures.Future[Any] | None:
    """``work``'s future; None for gloo's reduce-scatter, send and recv, which have none (and
    whose wait ignores a timeout, or fails the whole group at it)."""
    try:
        return work.get_future()
    except RuntimeError:
        return None


def _on_cpu(work: dist.Work) -> bool:
    """Whether torch's wait with a timeout blocks until the work ends or the timeout raises:
    a gloo work of CPU tensors; an NCCL work's wait only orders the CUDA stream behind it, so
    it is watched."""
    try:
        outputs = work.result()
    except RuntimeError:
        return False
    return bool(outputs) and all(t.device.type == "cpu" for t in outputs)


class _Ending:
    """How ``work`` ended, once it has, well or not (``ended`` set). A work with a future is
    watched through it; one without (gloo's reduce-scatter, send and recv) is waited for by a
    thread of ``_waiters``, once: a gloo send or recv counts its completions, so a second wait
    on it would wait for a message that never comes, and close the pair at its timeout. That
    thread's wait is bounded by the collective timeout: a send or recv waited for with no bound
    would be bounded by its group's connect timeout instead (groups.LazyGloo), seconds where a
    pipeline stage may wait a slow peer's whole forward."""

    def __init__(self, work: dist.Work, future: torch.futures.Future[Any] | None) -> None:
        self.ended = threading.Event()
        self._work = work
        self._waited = future is None
        self._error: RuntimeError | None = None
        if future is None:
            _waiters.submit(self)
        else:
            future.add_done_callback(lambda _: self.ended.set())

    def wait(self) -> None:
        """On a thread of ``_waiters``."""
        try:
            self._work.wait(COLLECTIVE_TIMEOUT)
        except RuntimeError as exc:  # raised by outcome(), in the caller's thread
            self._error = exc
        self.ended.set()

    def outcome(self) -> None:
        """Raise the work's error, if it ended with one (call once ``ended`` is set)."""
        if not self._waited:
            self._work.wait()
        elif self._error is not None:
            raise self._error


class _Waiters:
    """The threads that wait for works without a future, kept from one work to the next: a
    thread started per work cost the training thread a quarter of a millisecond per pipeline
    send or receive (profiled: ``Thread.start`` waits for the new thread to run, on cores the
    ranks fill), a kept one a put on its queue. A thread stays blocked as long as its work (one
    left behind, up to the collective timeout), so another is started whenever none is idle.
    Started on first use, and anew in a forked child (the fork server's ranks), which holds
    none of its parent's threads."""

    def __init__(self) -> None:
        self._forked()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Ending] = queue.SimpleQueue()
        self._idle = 0  # threads blocked on the queue, or about to be

    def submit(self, ending: _Ending) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            threading.Thread(target=self._run, name="flashrecovery-work", daemon=True).start()
        self._queue.put(ending)

    def _run(self) -> None:
        while True:
            self._queue.get().wait()
            with self._lock:
                self._idle += 1


_waiters = _Waiters()


def _leave_behind(group: object, ended: threading.Event) -> Superseded:
    with _lock:
        _left_behind.append((group, ended))
    return Superseded("a newer generation was planned while a collective waited")


def abandon_left_behind() -> int:
    """The process is leaving: the groups still left behind with work in flight (a peer cut
    off the network answers nothing until the collective timeout) are never destroyed, so the
    interpreter's exit does not wait out that timeout in their destructors and then abort on
    the collective's error. Returns how many were abandoned."""
    with _lock:
        abandoned = [g for g, e in _left_behind if not e.is_set()]
        _left_behind.clear()
    for group in abandoned:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # a reference nobody drops
    return len(abandoned)


def release_finished() -> None:
    """Let go of the groups left behind whose work has ended (dropping them is cheap now)."""
    with _lock:
        finished = [(g, e) for g, e in _left_behind if e.is_set()]
        _left_behind[:] = [(g, e) for g, e in _left_behind if not e.is_set()]
    del finished  # outside the lock: a group's destructor joins its threads
    _let_go_of_settled()


def _let_go_of_settled() -> None:
    """Drop the settled entries here, in a thread that is none of gloo's."""
    with _lock:
        settled = _settled[:]
        _settled.clear()
    del settled
