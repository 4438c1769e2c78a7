"""Where the job's current generation meets: the store its plan named.

Every agent of a multi-node job hosts a store of its own (agent/store.py); generation 0 meets on
node 0's, at the rendezvous endpoint, and a plan that follows the loss of the node holding the
meeting store names another (``RegroupPlanned.store``, chosen by the engine). The vote, the
barriers and the groups' rendezvous of a generation live there and nowhere else, so nothing a
later generation needs is lost with that node: each generation's keys are its own. An agent
follows the plans to know where to look for the end of the job, where its new processes meet,
and whether it is the one that keeps the meeting store up to the end and seals the log.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from flashrecovery.agent.store import JobStore
from flashrecovery.records import RegroupPlanned

CONNECT_TIMEOUT = datetime.timedelta(seconds=5)


class Meeting:
    def __init__(self, own: JobStore, launch: JobStore) -> None:
        self._own = own
        self.endpoint = launch.endpoint
        self._keys: dist.Store | None = launch.keys

    @property
    def here(self) -> bool:
        """Whether this agent hosts the meeting store (it then ends the job: agent/job.py)."""
        return self.endpoint == self._own.endpoint

    def follow(self, plan: RegroupPlanned) -> bool:
        """Take a plan in; True when it moved the meeting."""
        if plan.store is None or plan.store == self.endpoint:
            return False
        self.endpoint, self._keys = plan.store, None
        return True

    def keys(self) -> dist.Store:
        """The meeting store's keys (a RuntimeError while it cannot be reached)."""
        if self._keys is None:
            if self.here:
                self._keys = self._own.keys
            else:
                host, _, port = self.endpoint.rpartition(":")
                self._keys = JobStore.connect(
                    host, int(port), self._own.prefix, CONNECT_TIMEOUT
                ).keys
        return self._keys

    def lost(self) -> None:
        """The client broke (its host may be gone): connect again when next asked."""
        self._keys = None
