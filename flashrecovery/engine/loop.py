"""The engine's imperative shell: follow the events, decide, append the decisions.

On start it rebuilds its state from the whole log and writes only the decisions that are not
there yet (they have deterministic ids), so a restarted engine finishes an open incident with
exactly the decisions the old one would have written. With a lease TTL it shares the job with
other engines: only the lease holder writes decisions and runs detectors (engine/lease.py).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import structlog

from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.connectors.follow import RETRY, StreamCursor
from flashrecovery.connectors.signing import Keyring
from flashrecovery.engine import detectors
from flashrecovery.engine.detectors import Finding
from flashrecovery.engine.ingest import ingest
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.engine.state import EngineState
from flashrecovery.errors import LogError
from flashrecovery.records import (
    Decision,
    EngineLease,
    Envelope,
    NodeHeartbeat,
    NodeMissed,
    NodeWaitExpired,
    SpareMissed,
    Stream,
)
from flashrecovery.statemachines.job import ENDED

log = structlog.get_logger("flashrecovery.engine")
LOG_STALL_S = 1.0  # a read held up this much longer than asked means the log was away
# No fresh node heartbeat (by its own time) read for this many intervals: the log is away for
# its writers (a broker cut off holds their appends for seconds while this engine's reads just
# come back empty, then the beats held up arrive late), so silence proves nothing about any
# one node until fresh ones are read again.
LOG_QUIET_INTERVALS = 1.5


class EngineLoop:
    """Drives one job's engine from its log. ``clock`` is the only source of time."""

    def __init__(
        self,
        log_or_url: LogConnector | str,
        job_id: str,
        *,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.time,
        lease_ttl_s: float | None = None,
        engine_id: str | None = None,
        node: int | None = None,
        claim_after_s: float = 0.0,
        keys: Keyring | None = None,
    ) -> None:
        self.log = open_log(log_or_url) if isinstance(log_or_url, str) else log_or_url
        # With the job's keys it signs what it writes and believes only records signed by the
        # source they claim (connectors/signing.py); without them it believes every record.
        self.keys = keys
        if keys is not None:
            self.log.sign_with(keys)
        self._owns_log = isinstance(log_or_url, str)
        self.job_id = job_id
        self.poll_s = poll_s
        self.clock = clock
        self.state = EngineState(job_id)
        self.lease_ttl_s = lease_ttl_s
        self.engine_id = engine_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.leases = LeaseBook()
        self.node = node  # whose agent runs this engine (named in its leases)
        # A vacant lease is asked for only this long after the start: a preferred engine (a
        # control plane's) gets it first; the lease it renews keeps this one standing by.
        self._claim_from = clock() + claim_after_s
        self._leading = False
        self._due: list[Decision] = []  # decided, not yet written (a standby keeps them)
        self._written: set[str] = set()
        self._reported: set[detectors.FindingKey] = set()
        self._log_away = False  # the last attempt to use the log failed
        self._judge_silence_after = 0.0  # see detect()
        self._freshest_beat: float | None = None  # the newest NodeHeartbeat's own time
        self._stop = threading.Event()
        # Nothing in a step's records needs acting on at once: they are read at the next look
        # (every poll_s) instead of waking the engine for every step on the ranks' cores.
        self._events = StreamCursor(
            self.log, Stream.EVENTS, job_id, stop=self._stop, wake_on_routine=False
        )
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def next_position(self) -> int:
        """The first events position not applied yet."""
        return self._events.position

    # -------------------------------------------------------------- one step at a time

    def catch_up(self) -> None:
        """Apply every event so far, then write the decisions not in the log yet."""
        self.apply(self.log.read(Stream.EVENTS, self.job_id, self.next_position))

    def is_leader(self) -> bool:
        return self.lease_ttl_s is None or self.leases.holder(self.clock()) == self.engine_id

    def apply(self, entries: list[Entry]) -> int:
        """Decide on each entry; the leader appends the decisions not yet written."""
        for entry in entries:
            forgery = self.forgery(entry)
            if forgery is None:
                self.leases.fold(entry.record)
                if isinstance(entry.record, NodeHeartbeat):
                    self._freshest_beat = max(self._freshest_beat or 0.0, entry.record.ts)
            rejected, faults = self.state.rejected.total(), len(self.state.engine_faults)
            self._due.extend(ingest(self.state, entry, forgery))
            if self.state.rejected.total() > rejected:  # counted, explained, and said aloud
                log.warning(
                    "record rejected", position=entry.position, reason=self.state.last_rejection
                )
            if len(self.state.engine_faults) > faults:  # the engine's own bug, not the record's
                log.error("engine fault", detail=self.state.engine_faults[-1])
            self._events.position = entry.position + 1
        self._flush()
        return len(entries)

    def forgery(self, entry: Entry) -> str | None:
        """Why the entry's record is not its claimed source's (None: it is, or no keys)."""
        if self.keys is None or entry.record is None:
            return None
        return self.keys.forgery(entry.raw, entry.record)

    def _flush(self) -> None:
        if not self.is_leader():
            self._leading = False
            return
        if not self._leading:  # starting, or taking over: learn what is written already
            # Fenced first: a predecessor's decision still in flight (its node cut off) is then
            # never stored, so what is read now is all it decided and nothing is decided twice.
            self.log.fence(self.job_id)
            # (a forged decision bearing a due one's id must not keep the real one out)
            self._written = {
                e.record.record_id
                for e in self.log.read(Stream.DECISIONS, self.job_id)
                if e.record is not None and self.forgery(e) is None
            }
            self._leading = True
        batch = [d for d in self._due if d.record_id not in self._written]
        if batch and self.is_leader():
            try:
                self.log.append_many(Stream.DECISIONS, batch)  # one commit for a catch-up's worth
            except LogError:
                # Stored or not is unknown (a broker cut off may have kept it): the log says
                # which before they are written again, or they would be stored twice.
                self._leading = False
                raise
            for decision in batch:
                self._written.add(decision.record_id)
                log.info(
                    "decision",
                    type=decision.type,
                    caused_by=decision.caused_by,
                    generation=decision.generation,
                )
        self._due = []

    def claim(self) -> None:
        """Ask for the lease when nobody holds it, renew it when ours runs low."""
        if self.lease_ttl_s is None:
            return
        now = self.clock()
        holder, current = self.leases.holder(now), self.leases.current
        running_low = (
            holder == self.engine_id
            and current is not None
            and current.expires_ts - now < self.lease_ttl_s * 2 / 3
        )
        if (holder is None and now >= self._claim_from) or running_low:
            self.log.append(
                Stream.EVENTS,
                EngineLease(
                    job_id=self.job_id,
                    generation=self.state.generation,
                    source=f"engine:{self.engine_id}",
                    ts=now,
                    engine_id=self.engine_id,
                    expires_ts=now + self.lease_ttl_s,
                    node=self.node,
                ),
            )

    def detect(self) -> list[Envelope]:
        """Run the time-based detectors and append what they find, once per finding."""
        if not self.is_leader():
            return []
        now = self.clock()
        if now < self._judge_silence_after:
            return []  # the heartbeats sent while the log was away may be lost with it
        found: list[Envelope] = []
        for record in detectors.fresh_findings(self.state, now, self._reported):
            self.log.append(Stream.EVENTS, record)
            self._reported.add(detectors.finding_key(self.state, record))
            log.warning("detector", type=record.type, **key_fields(record))
            found.append(record)
        return found

    def step(self, timeout: float) -> int:
        began, failed_before = self.clock(), self._events.last_error
        self.claim()
        entries = self._events.poll(timeout)
        count = self.apply(entries)
        if not entries:
            self._flush()  # a standby whose predecessor's lease just ran out takes over here
        away = self._log_away or self._events.last_error is not failed_before
        if away:
            # What was decided just before is in doubt too: a decisions transaction the log
            # acknowledged as the broker went away was seen left open after it came back
            # (neither committed nor aborted: no reader saw it, the job hung). The next flush
            # fences again, which settles it, and reads what was decided.
            self._leading = False
        if away or self.clock() - began > timeout + LOG_STALL_S or self._log_quiet():
            # The log was away (an error, it held this step up, or no node is heard): the
            # beats meanwhile may be lost or late, so silence is judged afresh, a silence
            # limit after the log is back.
            self._log_away = False
            config = self.state.config
            limit = config.silence_limit_s if config else 0.0
            self._judge_silence_after = self.clock() + limit
        self.detect()
        return count

    def _log_quiet(self) -> bool:
        """No fresh node heartbeat read for LOG_QUIET_INTERVALS: every node at once falls
        silent only when the log does."""
        config = self.state.config
        if config is None or self._freshest_beat is None or self.state.job.state in ENDED:
            return False
        quiet_s = LOG_QUIET_INTERVALS * config.heartbeat_interval_s
        return self.clock() - self._freshest_beat > quiet_s

    # -------------------------------------------------------------- as a service

    def run(self) -> None:
        """Catch up, then follow until stop() is called or the job has ended. While the log is
        unreachable it retries by the log's one retry policy; decisions not yet acknowledged
        stay due and are written once it is back (their ids keep them from being written
        twice)."""
        backoff = 0.0
        caught_up = False
        while not self._stop.is_set() and self.state.job.state not in ENDED:
            try:
                if not caught_up:
                    self.catch_up()
                    caught_up = True
                self.step(self.poll_s)
                backoff = 0.0
            except LogError as exc:
                self._log_away = True
                backoff = RETRY.next_delay(backoff)
                log.warning("log unavailable, retrying", error=str(exc), retry_in_s=backoff)
                self._stop.wait(backoff)

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


def key_fields(record: Finding) -> dict[str, int | list[int]]:
    if isinstance(record, NodeMissed):
        return {"node": record.node}
    if isinstance(record, NodeWaitExpired):
        return {"ranks": record.ranks}
    if isinstance(record, SpareMissed):
        return {"spare_id": record.spare_id}
    return {"rank": record.rank}
