"""The engine's imperative shell: follow the events, decide, append the decisions.

On start it rebuilds its state from the whole log and writes only the decisions that are not
there yet (they have deterministic ids), so a restarted engine finishes an open incident with
exactly the decisions the old one would have written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.engine import detectors
from flashrecovery.engine.decide import ingest
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Envelope, Stream

log = structlog.get_logger("flashrecovery.engine")


class EngineLoop:
    """Drives one job's engine from its log. ``clock`` is the only source of time."""

    def __init__(
        self,
        log_or_url: LogConnector | str,
        job_id: str,
        *,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log = open_log(log_or_url) if isinstance(log_or_url, str) else log_or_url
        self._owns_log = isinstance(log_or_url, str)
        self.job_id = job_id
        self.poll_s = poll_s
        self.clock = clock
        self.state = EngineState(job_id)
        self._written: set[str] = set()
        self._reported: set[tuple[str, int, int, int | None]] = set()
        self._next = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def next_position(self) -> int:
        """The first events position not applied yet."""
        return self._next

    # -------------------------------------------------------------- one step at a time

    def catch_up(self) -> None:
        """Learn which decisions are already in the log, then apply every event so far."""
        self._written = {
            e.record.record_id
            for e in self.log.read(Stream.DECISIONS, self.job_id)
            if e.record is not None
        }
        self.apply(self.log.read(Stream.EVENTS, self.job_id, self._next))

    def apply(self, entries: list[Entry]) -> int:
        """Decide on each entry and append the decisions not yet written."""
        for entry in entries:
            for decision in ingest(self.state, entry):
                if decision.record_id in self._written:
                    continue
                self.log.append(Stream.DECISIONS, decision)
                self._written.add(decision.record_id)
                log.info(
                    "decision",
                    type=decision.type,
                    caused_by=entry.position,
                    generation=decision.generation,
                )
            self._next = entry.position + 1
        return len(entries)

    def detect(self) -> list[Envelope]:
        """Run the time-based detectors and append what they find, once per finding."""
        now = self.clock()
        found: list[Envelope] = []
        for record in [
            *detectors.silent_ranks(self.state, now),
            *detectors.stalled_ranks(self.state, now),
        ]:
            rank = getattr(record, "rank", -1)
            key = (record.type, record.generation, rank, self.state.ranks[rank].pid)
            if key in self._reported:
                continue
            self._reported.add(key)
            self.log.append(Stream.EVENTS, record)
            log.warning("detector", type=record.type, rank=rank)
            found.append(record)
        return found

    def step(self, timeout: float) -> int:
        entries = self.log.follow(Stream.EVENTS, self.job_id, self._next, timeout)
        count = self.apply(entries)
        self.detect()
        return count

    # -------------------------------------------------------------- as a service

    def run(self) -> None:
        """Catch up, then follow until stop() is called or the job has ended."""
        self.catch_up()
        while not self._stop.is_set() and self.state.job.state not in ("completed", "failed"):
            self.step(self.poll_s)

    def _run_guarded(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # reported to whoever joins the loop
            self.error = exc
            log.exception("engine loop crashed")

    def start(self) -> EngineLoop:
        self._thread = threading.Thread(target=self._run_guarded, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._owns_log:
            self.log.close()
