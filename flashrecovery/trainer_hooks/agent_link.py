"""A process's link to its node's agent (agent/links.py): it hands the agent its records instead
of writing them to the log, learns which of them are in the log, and receives the job's
decisions from it. Handing a record over never waits; only ``wait_logged`` does, and a rank
calls it just before its vote on the next step (docs/protocol.md, "A step")."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable

from flashrecovery.errors import LogError, RecordError
from flashrecovery.line_sender import LineSender
from flashrecovery.records import Decision, Envelope, Stream, dump_record, parse_record

WAIT_SLICE_S = 0.05  # how often a wait for the log looks whether it should give up


class AgentLink:
    def __init__(self, path: str) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.connect(path)
        self._changed = threading.Condition()
        self._handed = 0
        self._logged = 0
        self.closed = False  # the agent is gone (or the link was closed)
        self._sender = LineSender(self._socket, "agent-link-out")
        self._decisions: queue.SimpleQueue[Decision | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="agent-link-in", daemon=True)
        self._reader.start()

    def hand(self, record: Envelope) -> int:
        """Give the agent a record to write; returns its number among this process's records.
        Once this returns the record is the kernel's (it lands even if this process dies next),
        unless the agent is a socket buffer behind: then a thread sends it, and this still
        never waits."""
        line = dump_record(record) + b"\n"
        with self._changed:  # numbered and sent in one order
            self._handed += 1
            self._sender.send(line)
            return self._handed

    def wait_logged(self, number: int, timeout: float, give_up: Callable[[], bool]) -> bool:
        """Wait until the record ``number`` (and every one before it) is in the log: True; False
        as soon as ``give_up()`` holds or the agent is gone. LogError after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._logged < number:
                if self.closed or give_up():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LogError(
                        f"the agent did not get this process's record {number} into the log "
                        f"within {timeout:.0f}s"
                    )
                self._changed.wait(min(left, WAIT_SLICE_S))
        return True

    def poll_decisions(self, timeout: float) -> list[Decision]:
        """The decisions relayed since the last call, waiting up to ``timeout`` for one."""
        try:
            first = self._decisions.get(timeout=timeout)
        except queue.Empty:
            return []
        got = [first]
        with contextlib.suppress(queue.Empty):
            while True:
                got.append(self._decisions.get_nowait())
        return [d for d in got if d is not None]

    def _read(self) -> None:
        with contextlib.suppress(OSError), self._socket.makefile("rb") as lines:
            for line in lines:
                message = json.loads(line)
                if "ack" in message:
                    with self._changed:
                        self._logged = max(self._logged, int(message["ack"]))
                        self._changed.notify_all()
                    continue
                with contextlib.suppress(RecordError):
                    decision = parse_record(message, Stream.DECISIONS)
                    assert isinstance(decision, Decision)
                    self._decisions.put(decision)
        with self._changed:
            self.closed = True
            self._changed.notify_all()
        self._decisions.put(None)  # wakes a poll

    def close(self) -> None:
        """Send what was handed over, then close: the agent still writes it."""
        self._sender.close(2.0)
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._reader.join(1.0)
        self._socket.close()
