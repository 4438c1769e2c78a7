"""The heartbeat thread: proof of life that does not depend on the training loop progressing
(a rank blocked in a long collective still beats; a SIGSTOPped one does not)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from flashrecovery.connectors.base import LogConnector
from flashrecovery.errors import LogError
from flashrecovery.records import Envelope, Stream, dump_record


class HeartbeatThread:
    def __init__(
        self, to: LogConnector | str, interval_s: float, beat: Callable[[], Envelope | None]
    ) -> None:
        """``to``: the log (the agent beats for its node), or a rank's or spare's path to its
        agent's socket (agent/relay.py), whose record carries the beats; never blocking, so a
        stopped agent costs nothing."""
        self._log = to if isinstance(to, LogConnector) else None
        self._relay = to if isinstance(to, str) else None
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self._relay else None
        if self._socket is not None:
            self._socket.setblocking(False)
        self._interval_s = interval_s
        self._beat = beat  # builds the current heartbeat; None: nothing to say yet
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="flashrecovery-heartbeat", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval_s * 2 + 1)
        if self._socket is not None:
            self._socket.close()

    def _run(self) -> None:
        while True:
            record = self._beat()
            if record is not None:
                # A beat lost to a busy log (or agent) is what the detector tolerates; the next
                # may pass.
                if self._socket is not None and self._relay is not None:
                    with contextlib.suppress(OSError):
                        self._socket.sendto(dump_record(record), self._relay)
                elif self._log is not None:
                    # Handed over without waiting: a slow log never delays the next beat.
                    with contextlib.suppress(LogError):
                        self._log.append_async(Stream.EVENTS, record)
            if self._stop.wait(self._interval_s):
                return
