"""Where the job's current generation meets: the store its plan named.

Every agent of a multi-node job hosts a store of its own (agent/store.py); generation 0 meets
on node 0's (at the rendezvous endpoint, unless a control plane holds that), and a plan that
follows the loss of the node holding the meeting store names another (``RegroupPlanned.store``,
chosen by the engine). The vote, the barriers and the groups' rendezvous of a generation live
there and nowhere else, so nothing a later generation needs is lost with that node: each
generation's keys are its own. An agent follows the plans to know where its new processes
meet, where to look for the end of the job, and whether it is the one that keeps the meeting
store up to the end and seals the log.

The end is looked for by a thread of its own (``EndWatch``): a meeting store on a node just
lost answers nothing for seconds, and the agent's decisions must never wait for it. Nor may the
watch itself wait on a lost store once a plan moved the meeting: torch's client retries a
refused connection for its whole timeout, several times over (13 s seen), by when the new
store's host may have ended the job and gone. A plain connection tried first tells a store
that is gone (refused at once) or cut off (no answer within ``PROBE_S``) from one that is there.
A socket that takes connections with nobody serving it (a host frozen, or in the middle of
dying) passes that test, and torch's client then waits for its greeting for ever, whatever its
timeout: the client is made on a thread of its own, given up on after ``CONNECT_TIMEOUT``.
"""

from __future__ import annotations

import datetime
import queue
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from flashrecovery.agent.store import JobStore
from flashrecovery.errors import ConfigError
from flashrecovery.records import AssignSpare, Decision, RegroupPlanned, SpawnReplacement
from flashrecovery.trainer_hooks import barrier

CONNECT_TIMEOUT = datetime.timedelta(seconds=5)
LOOK_S = 0.2  # how often the end is looked for
MEETING_DECISIONS = (AssignSpare, SpawnReplacement, RegroupPlanned)  # those that name the store
PROBE_S = 1.0  # a store that does not take a connection within this is away for now


class Meeting:
    def __init__(self, own: JobStore, first: str) -> None:
        self._own = own
        self.endpoint = first  # generation 0's: node 0's store

    @property
    def here(self) -> bool:
        """Whether this agent hosts the meeting store (it then ends the job: agent/job.py)."""
        return self.endpoint == self._own.endpoint

    def follow(self, decision: Decision) -> bool:
        """Take a decision in; True when it moved the meeting. The spares an incident assigns
        name the new store before its plan does, and the spares started in their place must
        meet there too: the store they would have been given is on the node just lost."""
        store = decision.store if isinstance(decision, MEETING_DECISIONS) else None
        if store is None or store == self.endpoint:
            return False
        self.endpoint = store
        return True

    def keys(self) -> dist.Store:
        """A client of the meeting store (ConfigError or RuntimeError while it is away)."""
        if self.here:
            return self._own.keys
        host, _, port = self.endpoint.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=PROBE_S).close()
        except OSError as exc:
            raise ConfigError(f"the meeting store at {self.endpoint} is away: {exc}") from None
        made: queue.SimpleQueue[dist.Store | Exception] = queue.SimpleQueue()

        def connect() -> None:
            try:
                made.put(JobStore.connect(host, int(port), self._own.prefix, CONNECT_TIMEOUT).keys)
            except (RuntimeError, ConfigError) as exc:
                made.put(exc)

        # Daemon: a client stuck on a frozen host must not hold the agent's exit either.
        threading.Thread(target=connect, name="flashrecovery-meet", daemon=True).start()
        try:
            keys = made.get(timeout=CONNECT_TIMEOUT.total_seconds())
        except queue.Empty:
            raise ConfigError(f"the meeting store at {self.endpoint} does not answer") from None
        if isinstance(keys, Exception):
            raise keys
        return keys


class EndWatch:
    """Whether every member passed the current generation's ``done`` barrier, looked for on
    the meeting store from a thread of its own; ``away_s()``: how long it could not be asked."""

    def __init__(self, meeting: Meeting, generation: Callable[[], int]) -> None:
        self._meeting, self._generation = meeting, generation
        self.passed = threading.Event()
        self._away_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashrecovery-end", daemon=True)
        self._thread.start()

    def away_s(self) -> float:
        since = self._away_since
        return 0.0 if since is None else time.monotonic() - since

    def close(self) -> None:
        self._stop.set()
        self._thread.join(CONNECT_TIMEOUT.total_seconds() + 1)

    def _run(self) -> None:
        keys, endpoint = None, None
        while not self._stop.wait(LOOK_S):
            try:
                if keys is None or endpoint != self._meeting.endpoint:
                    endpoint = self._meeting.endpoint
                    keys = self._meeting.keys()
                if barrier.passed(keys, barrier.name(self._generation(), "done")):
                    self.passed.set()
                    return
                self._away_since = None
            except (RuntimeError, ConfigError):  # its host is lost: a plan will move it
                keys = None
                self._away_since = self._away_since or time.monotonic()
