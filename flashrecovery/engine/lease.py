"""Who may decide for a job: a lease recorded in the job's own log.

Engines append `EngineLease` records to the events stream; the log's order arbitrates. A lease
is accepted when no other engine holds an unexpired one at its timestamp; the holder renews it
well before it expires. Standby engines follow the same log, keep their state warm, and take over
once the holder's lease runs out, or at once when the agent of the holder's node is seen gone
(AgentExited) — then they write the decisions still due, which carry the same deterministic
ids, so none is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashrecovery.records import AgentExited, EngineLease, Envelope


@dataclass
class LeaseBook:
    """The lease currently granted, folded from the log's EngineLease records in order."""

    current: EngineLease | None = None

    def fold(self, record: Envelope | None) -> bool:
        """Fold one record of the events stream (only leases and agents' exits move the
        book); True when it granted a lease."""
        if isinstance(record, EngineLease):
            return self.observe(record)
        if isinstance(record, AgentExited):
            self.lost(record)
        return False

    def observe(self, lease: EngineLease) -> bool:
        """Fold one lease record; True when it was granted (a renewal or a takeover)."""
        held = self.current
        if held is None or held.engine_id == lease.engine_id or held.expires_ts <= lease.ts:
            self.current = lease
            return True
        return False

    def lost(self, exited: AgentExited) -> None:
        """The agent of a node is gone: a lease held on that node ends with it (every engine
        folds the same record at the same place of the log, so all of them agree)."""
        if self.current is not None and self.current.node == exited.node:
            self.current = None

    def holder(self, now: float) -> str | None:
        if self.current is None or self.current.expires_ts <= now:
            return None
        return self.current.engine_id
