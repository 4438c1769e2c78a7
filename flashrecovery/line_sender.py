"""Lines out on a local stream socket without ever waiting, in order: what the kernel takes at
once goes from the caller's thread, and only when the peer is a socket buffer behind does a
thread (started then) send the rest. A rank's records to its agent and the agent's
acknowledgements and decisions back go this way: a thread per direction woken for every line
cost both a wake-up per step on the cores the ranks train on (docs/benchmarks.md, "Where the
time goes")."""

from __future__ import annotations

import queue
import socket
import threading


class LineSender:
    def __init__(self, sock: socket.socket, name: str) -> None:
        self._socket = sock
        self._name = name
        self._lock = threading.Lock()
        self._queued = 0  # lines the thread has yet to send: later ones go after them
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def send(self, line: bytes) -> None:
        """Never waits; a peer that is gone is the reader's to notice, not the sender's."""
        with self._lock:
            if not self._queued:
                try:
                    line = line[self._socket.send(line, socket.MSG_DONTWAIT) :]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    return
            if line:
                self._queued += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._out.put(line)

    def _run(self) -> None:
        while (line := self._out.get()) is not None:
            try:
                self._socket.sendall(line)
            except OSError:
                return
            with self._lock:
                self._queued -= 1

    def close(self, timeout: float) -> None:
        """Send what is queued (bounded), then stop."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._out.put(None)
            thread.join(timeout)
