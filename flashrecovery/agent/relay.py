"""The node's heartbeats in one record: its processes hand their heartbeats to their agent over
a local datagram socket, and the agent's own NodeHeartbeat carries the newest of each, once per
interval. The log then takes one heartbeat record per node per interval, whatever the number
of ranks (docs/multinode.md); the engine applies each carried beat as if it came alone.

The socket lives in the agent's private directory (agent/nodedir.py), and a process only ever
sends without waiting: a stopped agent loses its node's beats, which is what its node's loss
means anyway.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

from flashrecovery.errors import RecordError
from flashrecovery.records import Heartbeat, SpareHeartbeat, parse_record

MAX_DATAGRAM = 65536


class BeatRelay:
    """The agent's end: ``path`` goes to its processes (FLASHRECOVERY_AGENT_SOCKET); ``take()``
    returns the newest beat of each process since the last call."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "beats.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self.path)
        self._lock = threading.Lock()
        self._beats: dict[tuple[str, int, int], Heartbeat | SpareHeartbeat] = {}
        self._thread = threading.Thread(target=self._receive, name="beat-relay", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                data = self._socket.recv(MAX_DATAGRAM)
            except OSError:
                return  # closed
            with contextlib.suppress(RecordError):
                beat = parse_record(data)
                if isinstance(beat, Heartbeat | SpareHeartbeat):
                    who = beat.rank if isinstance(beat, Heartbeat) else beat.spare_id
                    with self._lock:
                        self._beats[(beat.type, who, beat.pid)] = beat

    def take(self) -> list[Heartbeat | SpareHeartbeat]:
        with self._lock:
            beats, self._beats = list(self._beats.values()), {}
        return sorted(beats, key=lambda b: b.ts)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        self._thread.join(1.0)
