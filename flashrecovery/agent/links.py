"""A node's processes talk to their agent, not to the log (docs/multinode.md).

Each rank or spare holds one local stream connection to its agent (FLASHRECOVERY_AGENT_LINK,
in the agent's private directory): over it the process hands the agent its records, in order,
and the agent relays the job's decisions to it, so the log has one decisions follower per node.
The agent writes what its processes handed it in batches (``LogConnector.append_many``: one
write for a step's records of every rank of the node) and acknowledges each process's records
once they are in the log. A rank votes on a step only once its previous step's record is
acknowledged (trainer_hooks/agent_link.py), so the log never shows a member two steps ahead of
another, and a step waits on the log only when the log is a whole step behind.

Nothing a process handed over is lost with the process: the kernel keeps what it sent, and the
agent reads the connection to its end and writes it before it reports the process's exit.

The threads that take and write the records run at a lower priority than the ranks (``NICE``):
their work is due a step later, at the rank's next vote, so it waits for a core the ranks leave
idle (they do in every collective and vote) instead of preempting a rank's compute on its core
when a record comes in; a rank that waits for an acknowledgement leaves its core to them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import socket
import struct
import sys
import termios
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import structlog

from flashrecovery.connectors.base import LogConnector
from flashrecovery.connectors.follow import append_many_through_outage
from flashrecovery.errors import LogError, RecordError
from flashrecovery.line_sender import LineSender
from flashrecovery.records import (
    Decision,
    Envelope,
    RankFinished,
    StepCompleted,
    Stream,
    dump_record,
    parse_record,
)

log = structlog.get_logger("flashrecovery.agent")
# A step's records come from every rank of the node within moments of each other (they learn
# the verdict together): the writer waits for the rest, at most this long, before it writes a
# batch of steps. A rank needs its step's record in the log only at its next vote, which waits
# for the slowest rank anyway.
LINGER_S = 0.02
READ_BYTES = 1 << 16
# How much nicer than the agent the record threads are (the module's docstring says why; at 2
# ranks on 2 cores it took about 2 points off the hook's cost per step, docs/benchmarks.md).
NICE = 5


def _yield_to_ranks() -> None:
    """Lower this thread's priority (Linux: a thread's own nice value; threads it starts
    inherit it). The agent's other threads, its engine and store among them, keep theirs."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # a limit on nice values: run as before
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE)


def ack_line(count: int) -> bytes:
    """The agent's word that a process's first ``count`` records are in the log."""
    return json.dumps({"ack": count}).encode() + b"\n"


class _Link:
    """One process's connection: what it handed over, and what of that is in the log."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.pid: int = struct.unpack("3i", creds)[0]
        self.received = 0
        self.written = 0
        self.ended = False  # the process closed its end (or died): nothing more will come
        self.last_step = -1  # the newest step it handed over (-1: none, not training yet)
        self._sender = LineSender(conn, f"link-out-{self.pid}")

    def send(self, line: bytes) -> None:
        """Never waits: a stopped process never holds the agent up."""
        self._sender.send(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)
        self._sender.close(1.0)
        self.conn.close()


class ProcessLinks:
    """The agent's end: ``path`` goes to its processes; ``relay(decision)`` reaches every one
    (a process that connects later first gets the decisions relayed before it)."""

    def __init__(self, directory: Path, log_connector: LogConnector, patience_s: float) -> None:
        self.path = str(directory / "link.sock")
        self._log = log_connector
        self._patience_s = patience_s  # how long a batch is retried while the log is away
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._changed = threading.Condition()
        self._links: list[_Link] = []
        self._pending: list[tuple[_Link, Envelope]] = []
        self._history: list[bytes] = []  # the decisions relayed so far
        self._finished: set[int] = set()  # pids whose RankFinished is in the log
        self._closing = False
        self.batches = 0  # writes to the log so far
        self._threads = [
            threading.Thread(target=self._accept, name="link-accept", daemon=True),
            threading.Thread(target=self._write, name="link-writer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ decisions out

    def relay(self, decision: Decision) -> None:
        line = dump_record(decision) + b"\n"
        with self._changed:
            self._history.append(line)
            links = list(self._links)
        for link in links:
            link.send(line)

    # ------------------------------------------------------------------ records in

    def _accept(self) -> None:
        _yield_to_ranks()  # and the reader threads it starts
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            link = _Link(conn)
            with self._changed:
                self._links.append(link)
                for line in self._history:
                    link.send(line)
            threading.Thread(
                target=self._read, args=(link,), name=f"link-in-{link.pid}", daemon=True
            ).start()

    def _read(self, link: _Link) -> None:
        """Take the process's records as they come. Each read happens under the lock, so a
        record is either still in the socket or counted as received (``drain`` relies on it)."""
        partial = b""
        while True:
            try:  # poll, not select: the agent's process may hold fds past 1024
                poller = select.poll()
                poller.register(link.conn, select.POLLIN)
                poller.poll()
            except (OSError, ValueError):  # closed
                data = b""
            with self._changed:
                try:
                    data = link.conn.recv(READ_BYTES, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    link.ended = True
                    self._changed.notify_all()
                    return
                *lines, partial = (partial + data).split(b"\n")
                for line in lines:
                    self._take(link, line)
                self._changed.notify_all()

    def _step_incomplete(self) -> bool:
        """Whether the pending records are steps, and a training rank of the node has not
        handed over the newest of them yet (it will within moments, unless it is slow)."""
        steps = [r.step for _, r in self._pending if isinstance(r, StepCompleted)]
        if self._closing or len(steps) < len(self._pending):
            return False
        newest = max(steps)
        return any(0 <= x.last_step < newest and not x.ended for x in self._links)

    def _take(self, link: _Link, line: bytes) -> None:
        link.received += 1
        try:
            record = parse_record(line, Stream.EVENTS)
            if isinstance(record, StepCompleted):
                link.last_step = record.step
            self._pending.append((link, record))
        except RecordError as exc:  # not ours to write; acknowledged so that nobody waits
            log.warning("a process handed a bad record", pid=link.pid, error=exc.reason)
            link.written += 1
            link.send(ack_line(link.written))

    def _write(self) -> None:
        _yield_to_ranks()
        while True:
            with self._changed:
                while not self._pending and not self._closing:
                    self._changed.wait()
                if not self._pending:
                    return
                deadline = time.monotonic() + LINGER_S
                while self._step_incomplete() and (left := deadline - time.monotonic()) > 0:
                    self._changed.wait(left)
                batch, self._pending = self._pending, []
            records = [record for _, record in batch]
            try:
                append_many_through_outage(
                    self._log,
                    Stream.EVENTS,
                    records,
                    self._patience_s,
                    # steps alone: the engine acts on nothing in them at once, so it is not
                    # woken for every step on the cores the ranks train on
                    routine=all(isinstance(r, StepCompleted) for r in records),
                )
            except LogError as exc:  # no acknowledgement: the ranks' waits for it say so
                log.error("the log lost records of the node's processes", error=str(exc))
                continue
            with self._changed:
                self.batches += 1
                self._finished.update(x.pid for x, r in batch if isinstance(r, RankFinished))
                for link, count in Counter(link for link, _ in batch).items():
                    link.written += count
                    link.send(ack_line(link.written))
                self._changed.notify_all()

    def finished(self, pid: int) -> bool:
        """Whether process ``pid`` finished training: its ``RankFinished`` is in the log."""
        with self._changed:
            return pid in self._finished

    # ------------------------------------------------------------------ settling

    def drain(self, pid: int, timeout: float) -> bool:
        """Wait until the records of process ``pid``, which has exited, are all in the log
        (bounded): its exit is reported after them."""
        # Once it is dead, what it sent is all in the socket: read and written, it is drained
        # (a forked child of it may hold the connection open for a while yet).
        return self._settled(
            lambda x: x.pid != pid or ((x.ended or _unread(x.conn) == 0) and _logged(x)), timeout
        )

    def flush(self, timeout: float) -> bool:
        """Wait until every record handed over so far is in the log (bounded)."""
        return self._settled(_logged, timeout)

    def _settled(self, done: Callable[[_Link], bool], timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: all(done(x) for x in self._links), timeout)

    def close(self, timeout: float) -> None:
        """Stop accepting, write what the (ended) processes handed over, close every link."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._settled(lambda link: link.ended and _logged(link), timeout)
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            links = list(self._links)
        for thread in self._threads:
            thread.join(timeout)
        for link in links:
            link.close()


def _logged(link: _Link) -> bool:
    return link.written >= link.received


def _unread(conn: socket.socket) -> int:
    """Bytes the process sent that the agent has not read yet."""
    try:
        value: int = struct.unpack("i", fcntl.ioctl(conn, termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):  # closed
        return 0
    return value
